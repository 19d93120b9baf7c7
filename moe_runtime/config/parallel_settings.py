"""The parallel part of the engine's settings: the layout of ranks (EP, DP attention, TP, PP, CP), how tokens are
exchanged between them, and where routed experts live (replicas, rebalancing, host memory)."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.config_error import EngineConfigError


@dataclass
class ParallelSettings:
    # Parallel layout: world = ep ranks; dp_attn DP attention workers of ep // dp_attn ranks each.
    ep: int = 1
    dp_attn: int = 1
    tp: int = 1                          # tensor parallelism of dense models (heads, MLP, vocab)
    pp: int = 1                          # pipeline stages (layers split across ranks)
    pp_layers: tuple[int, ...] | None = None  # layers per stage; default: as even as possible
    pp_micro_batches: int = 0            # micro-batches per step so stages overlap (0 = pp)
    cp: int = 1                          # context parallelism: a DP worker's ranks split each step's tokens
                                         # (ep / dp_attn = attention TP x cp; without EP, tp x cp ranks)
    a2a_backend: str = "auto"            # "auto" | "local" | "all_to_all" | "allgather" | "deepep"
    dispatch_fp8: bool = False           # dispatch sends FP8 activations + per-128-column scales (GPU bandwidth)
    deepep_module: str = "deep_ep"       # the module whose `Buffer` is DeepEP's: deep_ep, or a drop-in (a fork)
    enable_two_batch_overlap: bool = False  # each step runs as two micro-batches, one's dispatch/combine in flight
                                         # while the other computes (SGLang's TBO, vLLM's DBO); see docs/design.md
    num_redundant_experts: int = 0       # extra physical expert slots for replicas of hot experts
    cpu_experts: bool = False            # routed experts in host memory, run by the CPU kernels on their own thread
                                         # while the shared experts run (KTransformers' split; moe/host_experts.py)
    device_resident_experts: int = 0     # with cpu_experts: each layer's N hottest routed experts (by recorded
                                         # load) keep a copy on the device and run there
    eplb_interval: int = 0               # rebalance experts every N steps (0 = only on demand)
    eplb_threshold: float = 0.0          # ... or when mean balancedness drops below this (0 = off)
    eplb_window: int = 128               # steps of expert load the rebalancer plans from
    eplb_layers_per_step: int = 0        # MoE layers whose weights move per step (0 = all at once)

    def validate(self) -> None:
        """The option checks. The layout's own (`validate_layout`) are repeated, with the values that would
        work, by `ParallelLayout.validate` once the checkpoint is read: `LLM` leaves them to it."""
        if self.ep == 1 and self.dispatch_fp8:
            raise EngineConfigError("--dispatch-fp8 needs --ep > 1 (one rank dispatches nothing over a wire)")
        if self.device_resident_experts < 0:
            raise EngineConfigError(f"--device-resident-experts {self.device_resident_experts}: must be >= 0")
        if self.device_resident_experts and not self.cpu_experts:
            raise EngineConfigError(f"--device-resident-experts {self.device_resident_experts} needs --cpu-experts "
                                    "(without it every routed expert is on the device already)")
        if self.cpu_experts and self.a2a_backend == "deepep":
            raise EngineConfigError("--cpu-experts with --a2a-backend deepep: DeepEP hands the experts device "
                                    "buffers (masked at decode) that the host kernel does not take; use "
                                    "all_to_all or allgather")
        if self.cp > 1 and self.enable_two_batch_overlap:
            raise EngineConfigError(f"--cp {self.cp} with --enable-two-batch-overlap: a context-parallel step "
                                    "exchanges every layer's new K/V over the whole step, which two micro-batches "
                                    "would have to pair up; use one of them")

    def validate_layout(self) -> None:
        if self.ep % self.dp_attn:
            raise EngineConfigError(f"--dp-attn {self.dp_attn} must divide --ep {self.ep} (each DP attention worker "
                                    f"spans ep / dp_attn ranks)")
        if self.ep == 1 and self.num_redundant_experts:
            raise EngineConfigError(f"--num-redundant-experts {self.num_redundant_experts} needs --ep > 1 "
                                    "(redundant copies spread load over ranks; one rank has nothing to spread)")
        if self.ep == 1 and self.eplb_interval:
            raise EngineConfigError(f"--eplb-interval {self.eplb_interval} needs --ep > 1 "
                                    "(one rank has nothing to rebalance)")
        if self.ep == 1 and self.a2a_backend not in ("auto", "local"):
            raise EngineConfigError(f"--a2a-backend {self.a2a_backend} needs --ep > 1; with one rank it is 'local'")

    def layout(self):
        from moe_runtime.config.parallel_layout import ParallelLayout

        return ParallelLayout(self.ep, self.dp_attn, self.num_redundant_experts, self.tp, self.pp,
                              tuple(self.pp_layers) if self.pp_layers else None, self.cp)

    @property
    def world_size(self) -> int:
        return self.layout().world_size
