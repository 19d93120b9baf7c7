"""All-gather dispatcher: every rank sees every token, computes its own experts, reduce-scatters.

Moves more bytes than all-to-all when tokens reach few ranks, but its collectives move equal
blocks per rank whose size does not depend on routing (only token counts are exchanged), which
suits small groups such as attention-TP groups and tiny decode batches. Uneven token counts are padded to the
largest rank's; gloo's missing or uneven reduce-scatter falls back to all-reduce + slice.

With `fp8_activations`, the gathered rows carry FP8 values + per-token-group scales instead of
the compute dtype (wire format: moe_runtime/dispatch/activation_wire.py); only the rows routed to this
rank's experts are dequantized. Combine's reduce-scatter moves the compute dtype.

Overlaps: the rows' all-gather (dispatch) and the reduce-scatter (combine) are started with
async_op and left in flight by `dispatch_start` / `combine_start` (moe_runtime/dispatch/pending.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from moe_runtime.dispatch.activation_wire import ActivationWire
from moe_runtime.dispatch.base import DispatchOutput, DispatchStats, OverlappingDispatcher
from moe_runtime.dispatch.collectives import (ColumnSpec, all_gather_counts, pack_rows, start_all_gather_rows,
                                              start_all_reduce_slice, start_reduce_scatter_rows, unpack_rows)
from moe_runtime.dispatch.grouping import ExpertGrouping, gather_grouped, group_by_local_expert, reduce_grouped
from moe_runtime.dispatch.pending import Pending
from moe_runtime.dispatch.slots import SlotLayout, check_dispatch_inputs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _AllGatherHandle:
    grouping: ExpertGrouping  # over the gathered rows [R * T_max]
    num_tokens: int
    padded_tokens: int        # T_max: every rank's block is padded to it
    dtype: torch.dtype
    stats: DispatchStats


class AllGatherDispatcher(OverlappingDispatcher):
    def __init__(self, slots: SlotLayout, rank: int, group=None,
                 hidden_size: int | None = None, fp8_activations: bool = False):
        self.slots = slots
        self.rank = rank
        self.group = group
        self.hidden_size = hidden_size
        self.fp8_activations = fp8_activations
        self._use_reduce_scatter = True  # switched off once if the backend lacks it

    def dispatch_start(self, x, slot_ids, weights) -> Pending[DispatchOutput]:
        """The token counts are gathered here, synchronously (they size every block); the rows'
        all-gather is what stays in flight."""
        check_dispatch_inputs(x, slot_ids, weights, self.slots.num_slots, self.hidden_size)
        num_ranks, num_topk = self.slots.num_ranks, slot_ids.shape[1]
        counts = all_gather_counts(x.shape[0], num_ranks, self.group, x.device)
        padded = max(counts)

        pad = padded - x.shape[0]
        wire = ActivationWire(x.shape[1], x.dtype, self.fp8_activations)
        rows = pack_rows(*wire.encode(x), slot_ids, weights.to(torch.float32))
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))                 # [T_max, B]
        gathering = start_all_gather_rows(rows, num_ranks, self.group)       # [R*T_max, B] once waited
        specs = [*wire.specs(), ColumnSpec(torch.int64, num_topk),
                 ColumnSpec(torch.float32, num_topk)]

        def arrived(gathered: torch.Tensor) -> DispatchOutput:
            *all_hidden, all_slots, all_weights = unpack_rows(gathered, specs)
            # Padding rows are zero bytes (slot 0): mask them out before routing.
            row_in_block = torch.arange(padded, device=x.device).repeat(num_ranks)
            real = row_in_block < torch.tensor(counts, device=x.device).repeat_interleave(padded)
            here = (self.slots.rank_of(all_slots) == self.rank) & real.unsqueeze(1)
            local = torch.where(here, self.slots.local_index_of(all_slots), -1)  # [R*T_max, K]
            grouping = group_by_local_expert(local, all_weights, self.slots.slots_per_rank)

            combine_row_bytes = x.shape[1] * x.element_size()  # partial sums: the compute dtype
            stats = DispatchStats(
                pairs_routed=int((slot_ids >= 0).sum()),
                rows_sent=padded * num_ranks,
                rows_sent_remote=padded * (num_ranks - 1),
                dispatch_bytes=padded * num_ranks * rows.shape[1] + 8 * num_ranks,
                combine_bytes=padded * (num_ranks - 1) * combine_row_bytes,
                remote_bytes=padded * (num_ranks - 1) * (rows.shape[1] + combine_row_bytes)
                + 8 * (num_ranks - 1),
            )
            self._stats = stats
            handle = _AllGatherHandle(grouping, x.shape[0], padded, x.dtype, stats)
            recv_x = wire.decode([gather_grouped(c, grouping) for c in all_hidden])   # [N, H]
            return DispatchOutput(recv_x=recv_x,
                                  tokens_per_local_expert=grouping.tokens_per_local_expert,
                                  handle=handle)

        return gathering.then(arrived)

    def combine_start(self, expert_out: torch.Tensor,
                      handle: _AllGatherHandle) -> Pending[torch.Tensor]:
        partial = reduce_grouped(expert_out, handle.grouping, handle.dtype)  # [R*T_max, H]
        num_ranks = self.slots.num_ranks
        pending = None
        if self._use_reduce_scatter:
            try:
                pending = start_reduce_scatter_rows(partial, num_ranks, self.group)
            except (RuntimeError, NotImplementedError) as err:
                # Same backend on every rank, so every rank takes this branch together.
                logger.info("reduce_scatter unavailable (%s); using all_reduce + slice", err)
                self._use_reduce_scatter = False
        if pending is None:
            pending = start_all_reduce_slice(partial, self.rank, num_ranks, self.group)
            handle.stats.combine_bytes *= 2
            handle.stats.remote_bytes += handle.padded_tokens * (num_ranks - 1) * (
                partial.shape[1] * partial.element_size())
        return pending.then(lambda mine: mine[:handle.num_tokens])
