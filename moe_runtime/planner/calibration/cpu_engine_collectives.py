"""What a multi-rank decode step of this runtime costs on this CPU beyond its ranks' own work, measured in the engine.

Two gloo processes timing bare collectives see a quiet machine: a collective's latency when both ranks sit in it
at once. Inside a running job a rank also waits for the other to arrive (the two finish their layers at
different times), the dispatcher packs and exchanges counts before the payload, and the front and the lock-step
loop run on the same cores. On two cores the bare figures under-priced an expert-parallel step by half. So the
runtime itself is run here, as a user runs it, on the calibration checkpoints, at two batch sizes each:
`ep=2, dp_attn=2` on the MoE model and `tp=2` on the dense one. Per decode step: a worker's forward time
(WorkerStats.step_seconds) and the front's wall time. `cpu_overhead_fit.py` takes from the forward what one rank
is predicted to spend on the same work (the rest is the EP cost per MoE layer, or the all-reduce cost) and from
the wall what the forward took (the control per step).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT_LEN = 16
DECODE_TOKENS = 24
REPEATS = 3


@dataclass(frozen=True)
class EngineDecode:
    """Per decode step of one layout (means over its DP workers), from WorkerStats deltas and the wall clock."""

    layout: dict
    batch_per_worker: int
    context: float             # mean cached tokens a decode step reads
    wall_s: float              # the front's wall time per step
    forward_s: float           # a worker's forward step (schedule to sample)
    kv_capacity_tokens: int    # the engine's KV capacity per DP worker


def measure_engine_decode(checkpoint: Path, layout: dict, batch_per_worker: int, prompt_len: int = PROMPT_LEN,
                          decode_tokens: int = DECODE_TOKENS, repeats: int = REPEATS,
                          kv_cache_memory: int = 64 * 2**20) -> EngineDecode:
    """Decode `batch_per_worker` requests per DP worker under `layout`: the decode span's per-step figures.

    A decode span is the difference of two runs over fresh prompts of the same shape (no prefix cache hits):
    one generating one token (prefill and the first sample), one generating 1 + `decode_tokens`; what remains
    is the decode steps. The median over `repeats` spans is kept (other processes come and go)."""
    import torch

    from moe_runtime.front.llm import LLM
    from moe_runtime.sampling.params import SamplingParams

    dp = layout.get("dp_attn", 1) if layout.get("ep", 1) > 1 else 1
    count = batch_per_worker * dp
    fresh = iter(range(1, 1 + 2 * repeats))

    def prompts(offset: int) -> list[list[int]]:
        return [[(7 * i + 131 * offset + j) % 4000 + 10 for j in range(prompt_len)] for i in range(count)]

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run(new: int) -> tuple[float, float]:
        before = llm.engine.stats().workers
        started = time.perf_counter()
        llm.generate(prompts(next(fresh)), greedy(new))
        wall = time.perf_counter() - started
        after = llm.engine.stats().workers
        return wall, _mean_delta(before, after, "step_seconds")

    spans = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a one-rank job runs in this process: one core per rank, as its ranks get
    with LLM(str(checkpoint), device="cpu", dtype="float32", kv_cache_memory=kv_cache_memory, **layout) as llm:
        llm.generate(prompts(0)[:2], greedy(3))   # warm-up
        for _ in range(repeats):
            short, long = run(1), run(1 + decode_tokens)
            spans.append([(b - a) / decode_tokens for a, b in zip(short, long)])
        kv_tokens = llm.engine.limits.kv_capacity_tokens
    torch.set_num_threads(threads)
    wall, forward = (statistics.median(values) for values in zip(*spans))
    return EngineDecode(dict(layout), batch_per_worker, prompt_len + decode_tokens / 2, wall, forward, kv_tokens)


def _mean_delta(before, after, name: str) -> float:
    deltas = [getattr(b, name) - getattr(a, name) for a, b in zip(before, after)]
    return sum(deltas) / max(len(deltas), 1)
