"""Building a dispatcher from a DispatchConfig, and choosing a backend for 'auto'."""

from __future__ import annotations

import logging

import torch

from dispatch.all_to_all import AllToAllDispatcher
from dispatch.allgather import AllGatherDispatcher
from dispatch.base import Dispatcher
from dispatch.capabilities import check_fp8_activations
from dispatch.backends import (BACKEND_ALL_TO_ALL, BACKEND_ALLGATHER, BACKEND_AUTO, BACKEND_DEEPEP,
                               BACKEND_DEEPEP_LOW_LATENCY, BACKEND_DEEPEP_NORMAL, BACKEND_LOCAL, BACKENDS,
                               PHASE_DECODE, PHASE_PREFILL, PHASES)
from dispatch.config import DispatchConfig
from dispatch.deepep import MODE_LOW_LATENCY, MODE_NORMAL, DeepEPDispatcher, deep_ep_importable
from dispatch.local import LocalDispatcher

logger = logging.getLogger(__name__)


def select_backend(name: str, device: torch.device | str, world_size: int,
                   phase: str | None = None) -> str:
    """Resolve a backend name to a concrete one.

    'auto': local for one rank; all_to_all on CPU (gloo); on CUDA, DeepEP normal for prefill
    (and unknown/mixed phases) or low-latency for decode when deep_ep imports, else all_to_all.
    'deepep' picks its mode by phase the same way. Concrete names pass through, checked.
    """
    if name not in BACKENDS:
        raise ValueError(f"dispatch backend {name!r} is not one of {BACKENDS}")
    if phase not in PHASES:
        raise ValueError(f"dispatch phase {phase!r} is not one of {PHASES}")
    device = torch.device(device)
    deepep_by_phase = BACKEND_DEEPEP_LOW_LATENCY if phase == PHASE_DECODE else BACKEND_DEEPEP_NORMAL
    if name == BACKEND_AUTO:
        if world_size == 1:
            return BACKEND_LOCAL
        if device.type == "cuda" and deep_ep_importable():
            return deepep_by_phase
        return BACKEND_ALL_TO_ALL
    if name == BACKEND_DEEPEP:
        return deepep_by_phase
    if name == BACKEND_LOCAL and world_size != 1:
        raise ValueError(f"dispatch backend 'local' needs world_size 1, got {world_size}")
    return name


def make_dispatcher(config: DispatchConfig) -> Dispatcher:
    """The dispatcher for `config`. When 'auto' or 'deepep' would pick DeepEP low-latency but
    `max_tokens_per_rank` is unset, DeepEP normal mode is used instead (an explicit
    'deepep_low_latency' without a bound is an error). `fp8_activations` is checked against the
    resolved backend, so 'auto' is refused when it lands on a backend that cannot do it."""
    backend = select_backend(config.backend, config.device, config.world_size, config.phase)
    if (backend == BACKEND_DEEPEP_LOW_LATENCY and config.max_tokens_per_rank is None
            and config.backend in (BACKEND_AUTO, BACKEND_DEEPEP)):
        # Low-latency kernels need a token bound; without one, a derived choice uses normal mode.
        logger.info("dispatch: no max_tokens_per_rank for DeepEP low-latency; using normal mode")
        backend = BACKEND_DEEPEP_NORMAL
    if config.fp8_activations:
        check_fp8_activations(backend, config.hidden_size, asked=config.backend)
    _announce(config, backend)
    if backend == BACKEND_LOCAL:
        return LocalDispatcher(config.slots, config.hidden_size)
    if backend == BACKEND_ALL_TO_ALL:
        return AllToAllDispatcher(config.slots, config.rank, config.group, config.hidden_size,
                                  send_once=config.send_once,
                                  fp8_activations=config.fp8_activations)
    if backend == BACKEND_ALLGATHER:
        return AllGatherDispatcher(config.slots, config.rank, config.group, config.hidden_size,
                                   fp8_activations=config.fp8_activations)
    mode = MODE_LOW_LATENCY if backend == BACKEND_DEEPEP_LOW_LATENCY else MODE_NORMAL
    return DeepEPDispatcher(config.slots, config.group, config.hidden_size, config.dtype, mode=mode,
                            max_tokens_per_rank=config.max_tokens_per_rank,
                            buffer_cls=config.deepep_buffer_cls,
                            fp8_activations=config.fp8_activations)


def _announce(config: DispatchConfig, backend: str) -> None:
    """Log the chosen backend once per rank at info level.

    An engine builds one dispatcher per phase (prefill, decode); on CPU both are the same backend, and
    two identical lines per rank said nothing. The decode one is announced only when it differs.
    """
    def chosen_for(phase: str) -> str:
        return select_backend(config.backend, config.device, config.world_size, phase)

    level, phase_note = logging.INFO, ""
    if config.phase == PHASE_DECODE and backend == chosen_for(PHASE_PREFILL):
        level = logging.DEBUG
    elif config.phase == PHASE_DECODE:
        phase_note = " for decode"
    elif config.phase == PHASE_PREFILL and backend != chosen_for(PHASE_DECODE):
        phase_note = " for prefill"
    logger.log(level, "dispatch backend %s%s (asked %s) on rank %d/%d, %d slots", backend, phase_note,
               config.backend, config.rank, config.world_size, config.num_slots)
