"""Two-phase all-to-all dispatcher (counts, then payload) over torch.distributed.

Send-once dedup: a token routed to several experts on one rank goes to that rank once, with
its list of (local expert, weight) for that rank. The receiver expands rows to (token, local
expert) entries grouped by expert; on combine it folds them back to one weighted partial sum per
received row and sends that back; the owner sums the partials of its token.

With `fp8_activations`, the dispatched rows carry FP8 values + per-token-group scales instead of
the compute dtype, in the same single all-to-all (wire format: moe_runtime/dispatch/activation_wire.py);
received rows are dequantized before they are grouped. Combine moves the compute dtype.

Works on gloo and NCCL (uneven splits through `all_to_all_single`). Overlaps: the payload of
`dispatch_start` and `combine_start` is an `all_to_all_single(async_op=True)` still in flight when
they return (moe_runtime/dispatch/pending.py); `dispatch`/`combine` are those, waited on at once.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_runtime.dispatch.activation_wire import ActivationWire
from moe_runtime.dispatch.base import DispatchOutput, DispatchStats, OverlappingDispatcher
from moe_runtime.dispatch.collectives import (ColumnSpec, exchange_counts, pack_rows, start_all_to_all_rows,
                                              unpack_rows)
from moe_runtime.dispatch.grouping import ExpertGrouping, gather_grouped, group_by_local_expert, reduce_grouped
from moe_runtime.dispatch.pending import Pending
from moe_runtime.dispatch.slots import SlotLayout, check_dispatch_inputs


@dataclasses.dataclass
class SendPlan:
    """Which rows this rank sends: one per (token, destination rank), or per (token, k)."""

    token_index: torch.Tensor   # [S] token of each sent row, rows ordered by destination rank
    local_expert: torch.Tensor  # [S, K] int32 local expert on the destination, -1 = not for it
    weight: torch.Tensor        # [S, K] float32 routing weight, 0 where local_expert is -1
    send_counts: torch.Tensor   # [R] int64 rows per destination rank


@dataclasses.dataclass
class _AllToAllHandle:
    send_token_index: torch.Tensor  # [S]
    send_splits: list[int]
    recv_splits: list[int]
    grouping: ExpertGrouping        # over the received rows
    num_tokens: int
    dtype: torch.dtype
    stats: DispatchStats


def plan_sends(slot_ids: torch.Tensor, weights: torch.Tensor, slots: SlotLayout,
               send_once: bool) -> SendPlan:
    """Rows to send for slot_ids [T, K] / weights [T, K], grouped by destination rank."""
    num_ranks = slots.num_ranks
    dest = slots.rank_of(slot_ids)                                      # [T, K], -1 masked
    local = slots.local_index_of(slot_ids).to(torch.int32)              # [T, K]
    if send_once:
        ranks = torch.arange(num_ranks, device=slot_ids.device)
        token_hits_rank = (dest.unsqueeze(-1) == ranks).any(dim=1)      # [T, R]
        unit_rank, unit_token = token_hits_rank.t().nonzero(as_tuple=True)  # rank-major
        unit_mask = dest[unit_token] == unit_rank.unsqueeze(1)          # [S, K]
    else:
        pair_token, pair_k = (dest >= 0).nonzero(as_tuple=True)
        pair_rank = dest[pair_token, pair_k]
        order = torch.sort(pair_rank, stable=True).indices
        unit_token, unit_rank = pair_token[order], pair_rank[order]
        unit_mask = torch.nn.functional.one_hot(pair_k[order], slot_ids.shape[1]).bool()
    return SendPlan(
        token_index=unit_token,
        local_expert=torch.where(unit_mask, local[unit_token], -1),
        weight=torch.where(unit_mask, weights[unit_token].to(torch.float32), 0.0),
        send_counts=torch.bincount(unit_rank, minlength=num_ranks).to(torch.int64),
    )


class AllToAllDispatcher(OverlappingDispatcher):
    def __init__(self, slots: SlotLayout, rank: int, group=None,
                 hidden_size: int | None = None, send_once: bool = True,
                 fp8_activations: bool = False):
        self.slots = slots
        self.rank = rank
        self.group = group
        self.hidden_size = hidden_size
        self.send_once = send_once
        self.fp8_activations = fp8_activations

    def dispatch_start(self, x, slot_ids, weights) -> Pending[DispatchOutput]:
        """The counts exchange (R int64 per rank) runs here, synchronously: the receive buffer is
        sized by it, as DeepEP's normal dispatch also learns its counts before it returns. The
        payload's all-to-all is what stays in flight."""
        check_dispatch_inputs(x, slot_ids, weights, self.slots.num_slots, self.hidden_size)
        num_topk = slot_ids.shape[1]
        plan = plan_sends(slot_ids, weights, self.slots, self.send_once)

        # Phase 1: how many rows go where. Phase 2: the rows, with their routing metadata.
        recv_counts = exchange_counts(plan.send_counts, self.group)
        send_splits, recv_splits = plan.send_counts.tolist(), recv_counts.tolist()
        wire = ActivationWire(x.shape[1], x.dtype, self.fp8_activations)
        meta = [ColumnSpec(torch.int32, num_topk), ColumnSpec(torch.float32, num_topk)]
        hidden_columns = [c.index_select(0, plan.token_index) for c in wire.encode(x)]  # [S, w]
        payload = pack_rows(*hidden_columns, plan.local_expert, plan.weight)
        received = start_all_to_all_rows(payload, send_splits, recv_splits, self.group)

        def arrived(rows: torch.Tensor) -> DispatchOutput:
            *recv_hidden, recv_local, recv_weight = unpack_rows(rows, [*wire.specs(), *meta])
            recv_rows = wire.decode(recv_hidden)                             # [Rn, H] x.dtype
            grouping = group_by_local_expert(recv_local.to(torch.int64), recv_weight,
                                             self.slots.slots_per_rank)
            stats = self._dispatch_stats(slot_ids, plan, send_splits, recv_splits, grouping,
                                         dispatch_row_bytes=wire.row_bytes,
                                         combine_row_bytes=x.shape[1] * x.element_size(),
                                         meta_bytes=sum(spec.nbytes for spec in meta))
            self._stats = stats
            handle = _AllToAllHandle(plan.token_index, send_splits, recv_splits, grouping,
                                     num_tokens=x.shape[0], dtype=x.dtype, stats=stats)
            return DispatchOutput(recv_x=gather_grouped(recv_rows, grouping),
                                  tokens_per_local_expert=grouping.tokens_per_local_expert,
                                  handle=handle)

        return received.then(arrived)

    def combine_start(self, expert_out: torch.Tensor,
                      handle: _AllToAllHandle) -> Pending[torch.Tensor]:
        partial = reduce_grouped(expert_out, handle.grouping, handle.dtype)   # [Rn, H]
        returned = start_all_to_all_rows(partial, handle.recv_splits, handle.send_splits,
                                         self.group)                           # [S, H] once waited

        def arrived(rows: torch.Tensor) -> torch.Tensor:
            acc_dtype = torch.promote_types(handle.dtype, torch.float32)
            y = torch.zeros(handle.num_tokens, partial.shape[1], dtype=acc_dtype,
                            device=partial.device)
            y.index_add_(0, handle.send_token_index, rows.to(acc_dtype))
            return y.to(handle.dtype)

        return returned.then(arrived)

    def _dispatch_stats(self, slot_ids, plan: SendPlan, send_splits, recv_splits,
                        grouping: ExpertGrouping, dispatch_row_bytes: int,
                        combine_row_bytes: int, meta_bytes: int) -> DispatchStats:
        """dispatch_row_bytes: hidden state per dispatched row (FP8 + scales, or the compute
        dtype); combine_row_bytes: per partial sum sent back (always the compute dtype)."""
        rows_sent, rows_back = sum(send_splits), sum(recv_splits)
        to_self, from_self = send_splits[self.rank], recv_splits[self.rank]
        counts_bytes = 8 * len(send_splits)
        pairs_routed = int((slot_ids >= 0).sum())
        pairs_received = int(grouping.row_index.numel())
        return DispatchStats(
            pairs_routed=pairs_routed,
            rows_sent=rows_sent,
            rows_sent_remote=rows_sent - to_self,
            dispatch_bytes=rows_sent * (dispatch_row_bytes + meta_bytes) + counts_bytes,
            combine_bytes=rows_back * combine_row_bytes,
            remote_bytes=((rows_sent - to_self) * (dispatch_row_bytes + meta_bytes)
                          + counts_bytes - 8 + (rows_back - from_self) * combine_row_bytes),
            bytes_saved_by_dedup=((pairs_routed - rows_sent) * dispatch_row_bytes
                                  + (pairs_received - rows_back) * combine_row_bytes),
        )
