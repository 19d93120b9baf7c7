"""Token dispatch/combine across expert-parallel ranks: one contract, several backends.

    dispatcher = make_dispatcher(DispatchConfig("auto", world_size, rank, group, num_slots, H))
    out = dispatcher.dispatch(x, slot_ids, weights)
    y = dispatcher.combine(experts(out.recv_x, out.tokens_per_local_expert), out.handle)
"""

from dispatch.all_to_all import AllToAllDispatcher
from dispatch.allgather import AllGatherDispatcher
from dispatch.base import (LAYOUT_CONTIGUOUS, LAYOUT_MASKED, DispatchOutput, DispatchStats,
                           Dispatcher)
from dispatch.config import BACKENDS, DispatchConfig
from dispatch.deepep import DeepEPDispatcher
from dispatch.factory import make_dispatcher, select_backend
from dispatch.local import LocalDispatcher
from dispatch.reference import naive_moe_reference
from dispatch.slots import SlotPlacement

__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "BACKENDS", "DeepEPDispatcher", "DispatchConfig",
    "DispatchOutput", "DispatchStats", "Dispatcher", "LAYOUT_CONTIGUOUS", "LAYOUT_MASKED",
    "LocalDispatcher", "SlotPlacement", "make_dispatcher", "naive_moe_reference",
    "select_backend",
]
