"""Where a decode step of this runtime spends its wall time: inside operators vs everything else.

One process, the engine in it (`LLM(...).core`): `batch` prompts are prefilled and decoded a
few steps unmeasured, then `steps` decode steps of `EngineCore.step()` (schedule, forward, sample,
bookkeeping; not the front's detokenization) run under torch.profiler (CPU activity only).

- kernel time: the self CPU time of every operator event (aten ops and any other `ns::op`), summed.
  Self time, so a composite op (aten::linear) and the op it calls (aten::addmm) are not counted
  twice. Intra-op worker threads are not separate events: an op's self time is how long the
  step's thread was inside it, comparable to the step's wall time.
- other: the step's wall time minus kernel time: Python, scheduling, sampling's Python, building
  the batch's metadata, and the profiler's own per-op cost (which is why the unprofiled step time
  is reported as well).

A view-like op (aten::view, aten::t, aten::as_strided) counts as kernel time although it is mostly
dispatcher overhead; `top_ops` and `op_calls_per_step` show how much of that there is.

With the captured decode step (`compile_decode`, `--enable-torch-compile`) inductor's generated C++
loops are no dispatcher operators: the time inside the compiled region (the profiler's "Torch-Compiled
Region" ranges: generated kernels, the extern GEMMs they call and inductor's thin generated wrapper
between them) counts as kernel time, plus the operators outside it (sampling, metadata).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

WARMUP_DECODE_STEPS = 3
TOP_OPS = 8


@dataclass(frozen=True)
class OpShare:
    name: str
    calls_per_step: float
    self_ms_per_step: float


@dataclass(frozen=True)
class StepBreakdown:
    """A decode step at `batch` sequences, per step averages over `steps` profiled steps."""
    batch: int
    steps: int
    step_ms: float                 # unprofiled wall time of a decode step
    profiled_step_ms: float        # wall time of a step under the profiler
    kernel_ms: float               # self CPU time of operator events per step
    op_calls_per_step: float       # dispatcher operator calls outside compiled regions
    top_ops: list[OpShare] = field(default_factory=list)

    @property
    def kernel_share(self) -> float:
        return min(self.kernel_ms / self.profiled_step_ms, 1.0)

    @property
    def other_share(self) -> float:
        return 1.0 - self.kernel_share

    def as_dict(self) -> dict:
        return dict(asdict(self), kernel_share=self.kernel_share, other_share=self.other_share)


def is_operator(event) -> bool:
    """A dispatcher operator (aten::mm, myns::op), not a record_function range or a Python frame."""
    return not event.is_user_annotation and "::" in event.key


def timed_steps(core, steps: int, batch: int) -> float:
    """Run `steps` decode steps of `core`, each advancing all `batch` sequences; their summed wall seconds."""
    total = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        deltas = core.step()
        total += time.perf_counter() - started
        if len(deltas) != batch:
            raise RuntimeError(f"a decode step advanced {len(deltas)} of {batch} sequences: not a full decode batch")
    return total


COMPILED_REGION = "Torch-Compiled Region"   # the profiler range dynamo opens around a compiled graph's call


def kernel_microseconds(events) -> tuple[float, int]:
    """(kernel time, operator calls) of a profile: the self time of operators outside compiled regions plus the
    whole time of compiled regions (whose operators are not counted again)."""
    regions = [e for e in events if e.name.startswith(COMPILED_REGION)]
    spans = {}
    for region in regions:
        spans.setdefault(region.thread, []).append((region.time_range.start, region.time_range.end))

    def inside(event) -> bool:
        return any(start <= event.time_range.start and event.time_range.end <= end
                   for start, end in spans.get(event.thread, ()))

    outside = [e for e in events if is_operator(e) and not inside(e)]
    total = sum(e.self_cpu_time_total for e in outside) + sum(r.cpu_time_total for r in regions)
    return total, len(outside)


def measure(path: str, dtype: str, prompts: list[list[int]], steps: int, compile_decode: bool = False) -> StepBreakdown:
    from torch.profiler import ProfilerActivity, profile

    from moe_runtime import LLM, SamplingParams

    batch = len(prompts)
    decode_steps = 2 * steps + WARMUP_DECODE_STEPS
    params = SamplingParams(max_tokens=decode_steps + 2, temperature=0.0, ignore_eos=True)
    with LLM(path, device="cpu", dtype=dtype, max_num_seqs=batch, enable_torch_compile=compile_decode) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"breakdown-{i}", prompt, params)
        started: set[str] = set()
        while len(started) < batch:       # prefill (in however many steps the scheduler takes) to a first token
            started.update(o.request_id for o in engine.step() if o.token_ids)
        core = llm.core                   # from here the front's output processing is left out
        timed_steps(core, WARMUP_DECODE_STEPS, batch)
        unprofiled = timed_steps(core, steps, batch)
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            profiled = timed_steps(core, steps, batch)
    operators = [e for e in profiler.key_averages() if is_operator(e)]
    kernel_us, calls = kernel_microseconds(profiler.events())
    top = sorted(operators, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return StepBreakdown(
        batch=batch, steps=steps, step_ms=unprofiled / steps * 1e3, profiled_step_ms=profiled / steps * 1e3,
        kernel_ms=kernel_us / steps / 1e3, op_calls_per_step=calls / steps,
        top_ops=[OpShare(e.key, e.count / steps, e.self_cpu_time_total / steps / 1e3) for e in top])


def run_step_breakdown(path: str, dtype: str, prompts: list[list[int]], steps: int, queue,
                       compile_decode: bool = False) -> None:
    """`measure` for bench_offline's subprocess: puts the breakdown's dict on `queue`."""
    torch.set_num_threads(torch.get_num_threads())
    queue.put(measure(path, dtype, prompts, steps, compile_decode).as_dict())
