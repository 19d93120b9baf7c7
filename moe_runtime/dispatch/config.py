"""Configuration of a dispatcher: which backend, which group, which shapes."""

from __future__ import annotations

import dataclasses

import torch

from moe_runtime.dispatch.backends import BACKEND_AUTO, BACKENDS, PHASES
from moe_runtime.dispatch.capabilities import check_fp8_activations
from moe_runtime.dispatch.slots import SlotLayout


@dataclasses.dataclass
class DispatchConfig:
    backend: str                     # one of BACKENDS
    slots: SlotLayout                # where the physical expert slots live; its ranks are the EP group's
    rank: int                        # this rank's index in that group
    group: object | None             # torch.distributed ProcessGroup; None = default group
    hidden_size: int
    dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"
    phase: str | None = None         # "prefill" | "decode" | None (mixed / unknown)
    max_tokens_per_rank: int | None = None  # bound on T per call; required for deepep low-latency
    send_once: bool = True           # all_to_all: send a token once per destination rank
    deepep_module: str = "deep_ep"          # the module whose `Buffer` is DeepEP's (a fork, or the tests' emulation)
    deepep_buffer_cls: type | None = None   # a `Buffer` class given directly (tests); None: deepep_module's
    # Dispatch (tokens -> experts) sends FP8 values + per-128-column float32 scales instead of
    # `dtype`; recv_x is dequantized to `dtype` on arrival, combine stays in `dtype`. Meant for GPU
    # interconnects (about half bf16's bytes); 'local' ignores it. See moe_runtime/dispatch/activation_wire.py.
    fp8_activations: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"DispatchConfig.backend {self.backend!r} is not one of {BACKENDS}")
        if self.phase not in PHASES:
            raise ValueError(f"DispatchConfig.phase {self.phase!r} is not one of {PHASES}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"DispatchConfig.rank {self.rank} is outside world_size "
                             f"{self.world_size}")
        if self.hidden_size < 1:
            raise ValueError(f"DispatchConfig.hidden_size must be >= 1, got {self.hidden_size}")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise ValueError(f"DispatchConfig.max_tokens_per_rank must be >= 1, got "
                             f"{self.max_tokens_per_rank}")
        if self.fp8_activations and self.backend != BACKEND_AUTO:
            check_fp8_activations(self.backend, self.hidden_size)  # 'auto': once resolved
        self.device = torch.device(self.device)

    @property
    def world_size(self) -> int:
        """Ranks in the expert-parallel group."""
        return self.slots.num_ranks

    @property
    def num_slots(self) -> int:
        """Physical expert slots over the whole group."""
        return self.slots.num_slots
