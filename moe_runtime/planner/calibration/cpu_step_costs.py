"""What a decode step of this runtime really costs on this CPU, by part, measured with the runtime itself.

A small model's decode on a CPU is not bound by FLOPs or bytes but by the framework: dozens of small torch
operators per layer, the MoE block's routing and per-expert loop, the sampler and the scheduler per step. No
rate predicts those, so they are timed: one in-process `EngineCore` (eager, one thread: one core per rank)
on a bench checkpoint, `batch` requests already prefilled, a few decode steps with forward hooks on every
layer's attention and on the whole layer. Per step that gives the attention part, the MLP part (MoE or
dense, norms and residual adds included) and the rest (embedding, final norm, LM head, sampling, scheduling).

The roofline keeps its compute and memory terms from the measured rates; what it adds on a CPU is the
difference between these times and those terms (`cpu_overheads.py`), so these are raw seconds per part.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

PROMPT_LEN = 32       # tokens each request is prefilled with before the timed decode steps
WARM_STEPS = 3        # decode steps run before timing (allocator, first-call paths)
TIMED_STEPS = 12      # decode steps timed (the median is kept)


@dataclass(frozen=True)
class StepParts:
    """Median seconds per decode step of one rank holding the whole model, by part."""

    batch: int                 # decoding requests
    context: float             # mean cached tokens each one reads
    attention_s: float         # all attention layers (projections, rotary, cache write, attention)
    moe_s: float               # all MoE layers' MLP part (norm, router, experts, shared expert, residual)
    dense_s: float             # all dense layers' MLP part
    rest_s: float              # embedding, final norm, LM head, sampling, scheduling
    moe_layers: int
    dense_layers: int

    @property
    def step_s(self) -> float:
        return self.attention_s + self.moe_s + self.dense_s + self.rest_s


def measure_step_parts(checkpoint: str | Path, batch: int, kv_cache_memory: int = 64 * 2**20) -> StepParts:
    """Decode `batch` requests on one thread and time the parts of each step (see the module's docstring)."""
    import torch

    from moe_runtime.config.engine_config import EngineConfig
    from moe_runtime.engine.core import EngineCore
    from moe_runtime.sampling.params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32",
                                   kv_cache_memory=kv_cache_memory, max_num_seqs=max(batch, 1)))
    try:
        layers = core.model.model.owned_layers()
        timers = _LayerTimers(layers)
        params = SamplingParams(max_tokens=WARM_STEPS + TIMED_STEPS + 4, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            core.add_request(f"calib-{i}", [(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)], params)
        while core.scheduler.waiting or not all(seq.is_decoding for seq in core.scheduler.running):
            core.step()                                   # prefill (maybe in chunks)
        for _ in range(WARM_STEPS):
            core.step()
        samples = []
        with timers:
            for _ in range(TIMED_STEPS):
                timers.reset()
                started = time.perf_counter()
                core.step()
                total = time.perf_counter() - started
                samples.append((total, *timers.totals()))
    finally:
        torch.set_num_threads(threads)
        core.shutdown()
    samples.sort(key=lambda s: s[0])
    total, attention, moe, dense = samples[len(samples) // 2]
    return StepParts(batch, PROMPT_LEN + WARM_STEPS + TIMED_STEPS / 2, attention, moe, dense,
                     max(total - attention - moe - dense, 0.0), timers.moe_layers, timers.dense_layers)


class _LayerTimers:
    """Forward hooks timing each layer and its attention (host clock: a CPU forward is synchronous)."""

    def __init__(self, layers):
        self.layers = layers
        self.is_moe = [_is_moe_layer(layer) for layer in layers]
        self.moe_layers = sum(self.is_moe)
        self.dense_layers = len(layers) - self.moe_layers
        self.handles = []
        self.reset()

    def reset(self) -> None:
        self.attention = [0.0] * len(self.layers)
        self.whole = [0.0] * len(self.layers)
        self._started: dict[tuple[int, str], float] = {}

    def totals(self) -> tuple[float, float, float]:
        """(attention, MoE MLP part, dense MLP part) seconds of the last step."""
        mlp = [w - a for w, a in zip(self.whole, self.attention)]
        moe = sum(m for m, is_moe in zip(mlp, self.is_moe) if is_moe)
        return sum(self.attention), moe, sum(mlp) - moe

    def __enter__(self):
        for i, layer in enumerate(self.layers):
            for part, module in (("attention", layer.self_attn), ("whole", layer)):
                self.handles.append(module.register_forward_pre_hook(self._pre(i, part)))
                self.handles.append(module.register_forward_hook(self._post(i, part)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre(self, i: int, part: str):
        def hook(module, args):
            self._started[(i, part)] = time.perf_counter()
        return hook

    def _post(self, i: int, part: str):
        def hook(module, args, output):
            getattr(self, part)[i] += time.perf_counter() - self._started.pop((i, part))
        return hook


def _is_moe_layer(layer) -> bool:
    """A layer whose MLP routes tokens to experts (registered with the MoE executor), not a dense MLP."""
    return hasattr(getattr(layer, layer.mlp_name), "moe_layer")
