"""Building a rank's dispatchers from a DispatchConfig, and choosing a backend for 'auto'."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from moe_runtime.dispatch.all_to_all import AllToAllDispatcher
from moe_runtime.dispatch.allgather import AllGatherDispatcher
from moe_runtime.dispatch.base import Dispatcher
from moe_runtime.dispatch.capabilities import check_fp8_activations
from moe_runtime.dispatch.backends import (BACKEND_ALL_TO_ALL, BACKEND_ALLGATHER, BACKEND_AUTO, BACKEND_DEEPEP,
                                           BACKEND_DEEPEP_LOW_LATENCY, BACKEND_DEEPEP_NORMAL, BACKEND_LOCAL, BACKENDS,
                                           PHASE_DECODE, PHASE_PREFILL, PHASES)
from moe_runtime.dispatch.config import DispatchConfig
from moe_runtime.dispatch.deepep import DEFAULT_DEEPEP_MODULE, DeepEPDispatcher, deep_ep_importable, import_deep_ep_buffer
from moe_runtime.dispatch.deepep_buffer import DeepEPBufferShape, SharedDeepEPBuffer
from moe_runtime.dispatch.deepep_preconditions import DEEPEP_DTYPE, MODE_LOW_LATENCY, MODE_NORMAL, deepep_refusal
from moe_runtime.dispatch.local import LocalDispatcher

logger = logging.getLogger(__name__)

_DEEPEP_BY_MODE = {MODE_NORMAL: BACKEND_DEEPEP_NORMAL, MODE_LOW_LATENCY: BACKEND_DEEPEP_LOW_LATENCY}
_MODE_BY_DEEPEP = {backend: mode for mode, backend in _DEEPEP_BY_MODE.items()}


@dataclass(frozen=True)
class BackendChoice:
    backend: str                 # a concrete backend name
    note: str | None = None      # why it is not the one asked for or DeepEP's ('auto' fell back), for the log


def choose_backend(name: str, device: torch.device | str, world_size: int, phase: str | None = None, *,
                   dtype: torch.dtype = DEEPEP_DTYPE, hidden_size: int | None = None,
                   deepep_module: str = DEFAULT_DEEPEP_MODULE) -> BackendChoice:
    """Resolve a backend name to a concrete one, for a model of `dtype` rows of `hidden_size` (None: not
    checked against DeepEP's sizes).

    'auto': local for one rank; all_to_all on CPU (gloo); on CUDA, DeepEP normal for prefill (and
    unknown/mixed phases) or low-latency for decode when DeepEP imports and accepts the rows, else
    all_to_all with a note saying why. 'deepep' picks its mode by phase the same way; where the
    low-latency kernels refuse the hidden size, decode uses the normal mode (with a note), and where no mode
    can run it is refused naming the reason. Concrete names pass through, checked.
    """
    if name not in BACKENDS:
        raise ValueError(f"dispatch backend {name!r} is not one of {BACKENDS}")
    if phase not in PHASES:
        raise ValueError(f"dispatch phase {phase!r} is not one of {PHASES}")
    device = torch.device(device)
    mode = MODE_LOW_LATENCY if phase == PHASE_DECODE else MODE_NORMAL
    refusal = deepep_refusal(mode, dtype, hidden_size)
    if name == BACKEND_AUTO:
        if world_size == 1:
            return BackendChoice(BACKEND_LOCAL)
        if device.type != "cuda" or not deep_ep_importable(deepep_module):
            return BackendChoice(BACKEND_ALL_TO_ALL)
        if refusal is not None:
            normal_refusal = deepep_refusal(MODE_NORMAL, dtype, hidden_size)
            return BackendChoice(BACKEND_ALL_TO_ALL, f"not DeepEP: {refusal}" if normal_refusal is not None
                                 else f"not DeepEP's low-latency mode: {refusal}")
        return BackendChoice(_DEEPEP_BY_MODE[mode])
    if name == BACKEND_DEEPEP:
        if refusal is None:
            return BackendChoice(_DEEPEP_BY_MODE[mode])
        normal_refusal = deepep_refusal(MODE_NORMAL, dtype, hidden_size)
        if mode == MODE_LOW_LATENCY and normal_refusal is None:
            return BackendChoice(BACKEND_DEEPEP_NORMAL, f"decode in DeepEP's normal mode: {refusal}")
        raise ValueError(f"dispatch backend 'deepep' cannot run: {refusal}; pick 'all_to_all' (or 'auto')")
    if name in (BACKEND_DEEPEP_NORMAL, BACKEND_DEEPEP_LOW_LATENCY):
        asked_refusal = deepep_refusal(_MODE_BY_DEEPEP[name], dtype, hidden_size)
        if asked_refusal is not None:
            raise ValueError(f"dispatch backend {name!r} cannot run: {asked_refusal}; pick 'all_to_all' (or 'auto')")
    if name == BACKEND_LOCAL and world_size != 1:
        raise ValueError(f"dispatch backend 'local' needs world_size 1, got {world_size}")
    return BackendChoice(name)


def select_backend(name: str, device: torch.device | str, world_size: int, phase: str | None = None,
                   **rows) -> str:
    """`choose_backend(...).backend`."""
    return choose_backend(name, device, world_size, phase, **rows).backend


def backend_for(config: DispatchConfig, phase: str | None) -> BackendChoice:
    """The backend `config` resolves to in `phase`, the low-latency mode needing a token bound."""
    choice = choose_backend(config.backend, config.device, config.world_size, phase, dtype=config.dtype,
                            hidden_size=config.hidden_size, deepep_module=config.deepep_module)
    if (choice.backend == BACKEND_DEEPEP_LOW_LATENCY and config.max_tokens_per_rank is None
            and config.backend in (BACKEND_AUTO, BACKEND_DEEPEP)):
        # Low-latency kernels need a token bound; without one, a derived choice uses normal mode.
        return BackendChoice(BACKEND_DEEPEP_NORMAL, "no max_tokens_per_rank for DeepEP's low-latency mode")
    return choice


def make_dispatcher(config: DispatchConfig, deepep_buffer: SharedDeepEPBuffer | None = None) -> Dispatcher:
    """The dispatcher for `config` in `config.phase`. A DeepEP one uses `deepep_buffer` when given (the rank's
    buffer shared by both modes, `make_phase_dispatchers`), else a buffer of its own. `fp8_activations` is
    checked against the resolved backend, so 'auto' is refused when it lands on a backend that cannot do it."""
    choice = backend_for(config, config.phase)
    backend = choice.backend
    if config.fp8_activations:
        check_fp8_activations(backend, config.hidden_size, asked=config.backend)
    _announce(config, choice)
    if backend == BACKEND_LOCAL:
        return LocalDispatcher(config.slots, config.hidden_size)
    if backend == BACKEND_ALL_TO_ALL:
        return AllToAllDispatcher(config.slots, config.rank, config.group, config.hidden_size,
                                  send_once=config.send_once,
                                  fp8_activations=config.fp8_activations)
    if backend == BACKEND_ALLGATHER:
        return AllGatherDispatcher(config.slots, config.rank, config.group, config.hidden_size,
                                   fp8_activations=config.fp8_activations)
    mode = _MODE_BY_DEEPEP[backend]
    if deepep_buffer is None:
        deepep_buffer = shared_deepep_buffer(config, frozenset({mode}))
    return DeepEPDispatcher(config.slots, deepep_buffer, config.hidden_size, config.dtype, mode=mode,
                            max_tokens_per_rank=config.max_tokens_per_rank,
                            fp8_activations=config.fp8_activations)


def make_phase_dispatchers(config: DispatchConfig) -> dict[str, Dispatcher]:
    """One dispatcher per step phase (prefill, decode) of a rank; `config.max_tokens_per_rank` bounds decode
    steps only. Where both phases use DeepEP, they share one buffer sized for both modes."""
    configs = {PHASE_PREFILL: dataclasses.replace(config, phase=PHASE_PREFILL, max_tokens_per_rank=None),
               PHASE_DECODE: dataclasses.replace(config, phase=PHASE_DECODE)}
    modes = frozenset(_MODE_BY_DEEPEP[choice.backend] for choice in (backend_for(c, p) for p, c in configs.items())
                      if choice.backend in _MODE_BY_DEEPEP)
    shared = shared_deepep_buffer(config, modes) if modes else None
    return {phase: make_dispatcher(c, shared) for phase, c in configs.items()}


def shared_deepep_buffer(config: DispatchConfig, modes: frozenset[str]) -> SharedDeepEPBuffer:
    """The rank's DeepEP buffer for `modes`, of `config.deepep_buffer_cls` or else `config.deepep_module`'s."""
    buffer_cls = config.deepep_buffer_cls or import_deep_ep_buffer(config.deepep_module)
    shape = DeepEPBufferShape(config.group, config.world_size, config.num_slots, config.slots.slots_per_rank,
                              config.hidden_size, config.hidden_size * config.dtype.itemsize,
                              config.max_tokens_per_rank if MODE_LOW_LATENCY in modes else None)
    return SharedDeepEPBuffer(buffer_cls, shape, modes)


def _announce(config: DispatchConfig, choice: BackendChoice) -> None:
    """Log the chosen backend once per rank at info level.

    An engine builds one dispatcher per phase (prefill, decode); on CPU both are the same backend, and
    two identical lines per rank said nothing. The decode one is announced only when it differs.
    """
    def chosen_for(phase: str) -> str:
        return backend_for(config, phase).backend

    backend = choice.backend
    level, phase_note = logging.INFO, ""
    if config.phase == PHASE_DECODE and backend == chosen_for(PHASE_PREFILL):
        level = logging.DEBUG
    elif config.phase == PHASE_DECODE:
        phase_note = " for decode"
    elif config.phase == PHASE_PREFILL and backend != chosen_for(PHASE_DECODE):
        phase_note = " for prefill"
    because = f" ({choice.note})" if choice.note else ""
    if choice.note and config.phase == PHASE_DECODE and choice.note == backend_for(config, PHASE_PREFILL).note:
        because = ""                                               # said once, for prefill
    if because:
        level = logging.INFO
    logger.log(level, "dispatch backend %s%s (asked %s) on rank %d/%d, %d slots%s", backend, phase_note,
               config.backend, config.rank, config.world_size, config.num_slots, because)
