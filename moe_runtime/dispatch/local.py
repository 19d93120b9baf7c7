"""Single-rank dispatcher: no communication, (token, k) pairs grouped by slot."""

from __future__ import annotations

import dataclasses

import torch

from moe_runtime.dispatch.base import DispatchOutput, DispatchStats, Dispatcher
from moe_runtime.dispatch.grouping import ExpertGrouping, gather_grouped, group_by_local_expert, reduce_grouped
from moe_runtime.dispatch.slots import SlotLayout, check_dispatch_inputs


@dataclasses.dataclass
class _LocalHandle:
    grouping: ExpertGrouping
    dtype: torch.dtype


class LocalDispatcher(Dispatcher):
    """One rank: every slot is a local expert.

    DispatchConfig.fp8_activations is accepted and ignored: nothing crosses a wire, so there are
    no bytes to save, and recv_x keeps x's exact values (`sends_fp8_activations()` is False).
    """

    def __init__(self, slots: SlotLayout, hidden_size: int | None = None):
        if slots.num_ranks != 1:
            raise ValueError(f"LocalDispatcher needs slots on one rank, got {slots.num_ranks} ranks")
        self.slots = slots
        self.hidden_size = hidden_size

    @classmethod
    def fp8_activations_refusal(cls, hidden_size: int) -> str | None:
        return None  # accepted, and ignored: see the class docstring

    def dispatch(self, x, slot_ids, weights) -> DispatchOutput:
        check_dispatch_inputs(x, slot_ids, weights, self.slots.num_slots, self.hidden_size)
        local_expert = self.slots.local_index_of(slot_ids)          # [T, K]
        grouping = group_by_local_expert(local_expert, weights, self.slots.slots_per_rank)
        self._stats = DispatchStats(pairs_routed=int(grouping.row_index.numel()))
        return DispatchOutput(recv_x=gather_grouped(x, grouping),
                              tokens_per_local_expert=grouping.tokens_per_local_expert,
                              handle=_LocalHandle(grouping, x.dtype))

    def combine(self, expert_out: torch.Tensor, handle: _LocalHandle) -> torch.Tensor:
        return reduce_grouped(expert_out, handle.grouping, handle.dtype)
