"""What a backend can do, asked by name before a dispatcher is built.

Capabilities live on the dispatcher classes (moe_runtime/dispatch/base.py); this maps a backend name to the
class that serves it, so DispatchConfig can refuse an option when it is made rather than when
the first layer dispatches. 'auto' names no class until the factory resolves it against the
device and DeepEP's presence, so its check runs there, on the resolved name.
"""

from __future__ import annotations

from moe_runtime.dispatch.all_to_all import AllToAllDispatcher
from moe_runtime.dispatch.allgather import AllGatherDispatcher
from moe_runtime.dispatch.backends import (BACKEND_ALL_TO_ALL, BACKEND_ALLGATHER, BACKEND_DEEPEP,
                                           BACKEND_DEEPEP_LOW_LATENCY, BACKEND_DEEPEP_NORMAL, BACKEND_LOCAL)
from moe_runtime.dispatch.base import Dispatcher
from moe_runtime.dispatch.deepep import DeepEPDispatcher
from moe_runtime.dispatch.local import LocalDispatcher


def dispatcher_class(backend: str) -> type[Dispatcher] | None:
    """The class serving a backend name; None for 'auto' (and unknown names)."""
    return {
        BACKEND_LOCAL: LocalDispatcher,
        BACKEND_ALL_TO_ALL: AllToAllDispatcher,
        BACKEND_ALLGATHER: AllGatherDispatcher,
        BACKEND_DEEPEP: DeepEPDispatcher,
        BACKEND_DEEPEP_NORMAL: DeepEPDispatcher,
        BACKEND_DEEPEP_LOW_LATENCY: DeepEPDispatcher,
    }.get(backend)


def check_fp8_activations(backend: str, hidden_size: int, asked: str | None = None) -> None:
    """Raise ValueError naming `backend` (and the name `asked`, when it resolved from another)
    if it cannot send FP8 activations for rows of `hidden_size`. 'auto' passes unchecked."""
    cls = dispatcher_class(backend)
    refusal = cls.fp8_activations_refusal(hidden_size) if cls is not None else None
    if refusal is not None:
        chosen = f" (chosen for {asked!r})" if asked not in (None, backend) else ""
        raise ValueError(f"DispatchConfig.fp8_activations: dispatch backend {backend!r}{chosen} "
                         f"cannot send FP8 activations: {refusal}; turn fp8_activations off or "
                         f"pick backend 'all_to_all' or 'allgather'")
