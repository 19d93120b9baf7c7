"""Token dispatch/combine across expert-parallel ranks: one contract, several backends.

    dispatcher = make_dispatcher(DispatchConfig("auto", slots, rank, group, H))   # slots: a SlotLayout
    out = dispatcher.dispatch(x, slot_ids, weights)
    y = dispatcher.combine(experts(out.recv_x, out.tokens_per_local_expert), out.handle)

    pending = dispatcher.dispatch_start(x, slot_ids, weights)   # two-phase form: compute meanwhile,
    out = pending.wait()                                        # then wait (moe_runtime/dispatch/pending.py)

The names below load on first use, so that `dispatch.backends` (the backend names) imports without torch.
"""
from __future__ import annotations

import importlib


_EXPORTS = {
    "AllToAllDispatcher": "moe_runtime.dispatch.all_to_all", "AllGatherDispatcher": "moe_runtime.dispatch.allgather",
    "LAYOUT_CONTIGUOUS": "moe_runtime.dispatch.base", "LAYOUT_MASKED": "moe_runtime.dispatch.base", "DispatchOutput": "moe_runtime.dispatch.base",
    "DispatchStats": "moe_runtime.dispatch.base", "Dispatcher": "moe_runtime.dispatch.base", "BACKENDS": "moe_runtime.dispatch.backends",
    "DispatchConfig": "moe_runtime.dispatch.config", "DeepEPDispatcher": "moe_runtime.dispatch.deepep", "make_dispatcher": "moe_runtime.dispatch.factory",
    "select_backend": "moe_runtime.dispatch.factory", "LocalDispatcher": "moe_runtime.dispatch.local",
    "naive_moe_reference": "moe_runtime.dispatch.reference", "SlotLayout": "moe_runtime.dispatch.slots",
    "Fp8Activations": "moe_runtime.dispatch.fp8_activations", "quantize_token_groups": "moe_runtime.dispatch.fp8_activations",
    "dequantize": "moe_runtime.dispatch.fp8_activations", "Pending": "moe_runtime.dispatch.pending", "Ready": "moe_runtime.dispatch.pending",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moe_runtime.dispatch' has no attribute {name!r}")
