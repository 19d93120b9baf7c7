"""Token dispatch/combine across expert-parallel ranks: one contract, several backends.

    dispatcher = make_dispatcher(DispatchConfig("auto", slots, rank, group, H))   # slots: a SlotLayout
    out = dispatcher.dispatch(x, slot_ids, weights)
    y = dispatcher.combine(experts(out.recv_x, out.tokens_per_local_expert), out.handle)

    pending = dispatcher.dispatch_start(x, slot_ids, weights)   # two-phase form: compute meanwhile,
    out = pending.wait()                                        # then wait (dispatch/pending.py)

The names below load on first use, so that `dispatch.backends` (the backend names) imports without torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "AllToAllDispatcher": "dispatch.all_to_all", "AllGatherDispatcher": "dispatch.allgather",
    "LAYOUT_CONTIGUOUS": "dispatch.base", "LAYOUT_MASKED": "dispatch.base", "DispatchOutput": "dispatch.base",
    "DispatchStats": "dispatch.base", "Dispatcher": "dispatch.base", "BACKENDS": "dispatch.backends",
    "DispatchConfig": "dispatch.config", "DeepEPDispatcher": "dispatch.deepep", "make_dispatcher": "dispatch.factory",
    "select_backend": "dispatch.factory", "LocalDispatcher": "dispatch.local",
    "naive_moe_reference": "dispatch.reference", "SlotLayout": "dispatch.slots",
    "Fp8Activations": "dispatch.fp8_activations", "quantize_token_groups": "dispatch.fp8_activations",
    "dequantize": "dispatch.fp8_activations", "Pending": "dispatch.pending", "Ready": "dispatch.pending",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dispatch' has no attribute {name!r}")
