"""All-gather dispatcher: every rank sees every token, computes its own experts, reduce-scatters.

Moves more bytes than all-to-all when tokens reach few ranks, but its collectives move equal
blocks per rank whose size does not depend on routing (only token counts are exchanged), which
suits small groups such as attention-TP groups and tiny decode batches. Uneven token counts are padded to the
largest rank's; gloo's missing or uneven reduce-scatter falls back to all-reduce + slice.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dispatch.base import DispatchOutput, DispatchStats, Dispatcher
from dispatch.collectives import (ColumnSpec, all_gather_counts, all_gather_rows,
                                  all_reduce_slice, pack_rows, reduce_scatter_rows, unpack_rows)
from dispatch.grouping import ExpertGrouping, gather_grouped, group_by_local_expert, reduce_grouped
from dispatch.slots import SlotLayout, check_dispatch_inputs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _AllGatherHandle:
    grouping: ExpertGrouping  # over the gathered rows [R * T_max]
    num_tokens: int
    padded_tokens: int        # T_max: every rank's block is padded to it
    dtype: torch.dtype
    stats: DispatchStats


class AllGatherDispatcher(Dispatcher):
    def __init__(self, slots: SlotLayout, rank: int, group=None,
                 hidden_size: int | None = None):
        self.slots = slots
        self.rank = rank
        self.group = group
        self.hidden_size = hidden_size
        self._use_reduce_scatter = True  # switched off once if the backend lacks it

    def dispatch(self, x, slot_ids, weights) -> DispatchOutput:
        check_dispatch_inputs(x, slot_ids, weights, self.slots.num_slots, self.hidden_size)
        num_ranks, num_topk = self.slots.num_ranks, slot_ids.shape[1]
        counts = all_gather_counts(x.shape[0], num_ranks, self.group, x.device)
        padded = max(counts)

        pad = padded - x.shape[0]
        rows = pack_rows(x, slot_ids, weights.to(torch.float32))
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))                 # [T_max, B]
        gathered = all_gather_rows(rows, num_ranks, self.group)              # [R*T_max, B]
        specs = [ColumnSpec(x.dtype, x.shape[1]), ColumnSpec(torch.int64, num_topk),
                 ColumnSpec(torch.float32, num_topk)]
        all_x, all_slots, all_weights = unpack_rows(gathered, specs)

        # Padding rows are zero bytes (slot 0): mask them out before routing.
        row_in_block = torch.arange(padded, device=x.device).repeat(num_ranks)
        real = row_in_block < torch.tensor(counts, device=x.device).repeat_interleave(padded)
        here = (self.slots.rank_of(all_slots) == self.rank) & real.unsqueeze(1)
        local = torch.where(here, self.slots.local_index_of(all_slots), -1)  # [R*T_max, K]
        grouping = group_by_local_expert(local, all_weights, self.slots.slots_per_rank)

        row_bytes = specs[0].nbytes
        stats = DispatchStats(
            pairs_routed=int((slot_ids >= 0).sum()),
            rows_sent=padded * num_ranks,
            rows_sent_remote=padded * (num_ranks - 1),
            dispatch_bytes=padded * num_ranks * rows.shape[1] + 8 * num_ranks,
            combine_bytes=padded * (num_ranks - 1) * row_bytes,
            remote_bytes=padded * (num_ranks - 1) * (rows.shape[1] + row_bytes)
            + 8 * (num_ranks - 1),
        )
        self._stats = stats
        handle = _AllGatherHandle(grouping, x.shape[0], padded, x.dtype, stats)
        return DispatchOutput(recv_x=gather_grouped(all_x, grouping),
                              tokens_per_local_expert=grouping.tokens_per_local_expert,
                              handle=handle)

    def combine(self, expert_out: torch.Tensor, handle: _AllGatherHandle) -> torch.Tensor:
        partial = reduce_grouped(expert_out, handle.grouping, handle.dtype)  # [R*T_max, H]
        num_ranks = self.slots.num_ranks
        if self._use_reduce_scatter:
            try:
                mine = reduce_scatter_rows(partial, num_ranks, self.group)
            except (RuntimeError, NotImplementedError) as err:
                # Same backend on every rank, so every rank takes this branch together.
                logger.info("reduce_scatter unavailable (%s); using all_reduce + slice", err)
                self._use_reduce_scatter = False
        if not self._use_reduce_scatter:
            mine = all_reduce_slice(partial, self.rank, num_ranks, self.group)
            handle.stats.combine_bytes *= 2
            handle.stats.remote_bytes += handle.padded_tokens * (num_ranks - 1) * (
                partial.shape[1] * partial.element_size())
        return mine[:handle.num_tokens]
