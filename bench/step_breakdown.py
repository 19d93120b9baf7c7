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
import types
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


# ---- one decode step through each way of running it: eager, dynamo + inductor's Python or C++ wrapper, AOTInductor

RUNNERS = ("eager", "python", "cpp", "aot")


@dataclass(frozen=True)
class RunnerTiming:
    """One batch's decode step (the model's forward + LM head on fixed inputs) through one runner."""
    runner: str                    # RUNNERS
    step_ms: float                 # median over the rounds (each round: `calls` steps back to back)
    best_step_ms: float
    extern_share: float            # of a profiled step's wall time, the share inside dispatcher operators: the
                                   # compiled CPU kernels (moe_cpu::*) and aten's; inductor's generated loops are
                                   # not among them (they are the rest, with the wrapper's own time)
    weight_gbs: float              # the step's weight bytes over its median time
    bound_fraction: float          # the copy-bandwidth bound's step time (bytes / copy bandwidth) over step_ms


def step_inputs(capture, batch: int, position: int = 64) -> tuple[torch.Tensor, ...]:
    """A decode step's five tensors for `batch` rows at `position`, each row its own blocks of the pool."""
    block_size = capture.block_size
    width = max(-(-(position + 1) // block_size), 2)
    tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width)                         # [B, W]
    slots = tables[:, position // block_size].long() * block_size + position % block_size           # [B]
    return (torch.full((batch,), 5, dtype=torch.long), torch.full((batch,), position, dtype=torch.long), slots,
            tables, torch.full((batch,), position + 1, dtype=torch.int32))


def _own_code(step, name: str):
    """`step` behind a function of its own code object: dynamo keeps its graphs per code object, so two compiles of
    one function (Python and C++ wrappers) would otherwise share, and with guards skipped mix up, their entries."""
    def call(*inputs):
        return step(*inputs)
    return types.FunctionType(call.__code__.replace(co_name=f"step_{name}"), call.__globals__, closure=call.__closure__)


def compare_runners(path: str, dtype: str, batch: int, kernels: str, step_bytes: float, bandwidth_gbs: float,
                    rounds: int = 5, calls: int = 10, runners: tuple[str, ...] = RUNNERS) -> list[RunnerTiming]:
    """The same step through each runner, rounds interleaved (runner A, B, C, D, A, B, ...) so that load from other
    processes hits them alike; the compiles happen before (inductor's and AOTInductor's disk caches make a rerun
    quick)."""
    from torch.profiler import ProfilerActivity, profile

    from moe_runtime import LLM, SamplingParams
    from moe_runtime.execution.aot_step import compile_bucket

    with LLM(path, device="cpu", dtype=dtype, max_num_seqs=batch, kernels=kernels, enable_torch_compile=True,
             torch_compile_backend="eager") as llm:
        llm.generate([[5] * 8], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))   # kernels built
        capture = llm.core.runner.capture
        inputs = step_inputs(capture, batch)
        step = capture._decode_step
        made = {"eager": lambda: step,
                "python": lambda: torch.compile(_own_code(step, "python"), fullgraph=True, dynamic=False),
                "cpp": lambda: torch.compile(_own_code(step, "cpp"), fullgraph=True, dynamic=False,
                                             options={"cpp_wrapper": True}),
                "aot": lambda: compile_bucket(capture.model, capture.caches, step, inputs).run}
        run = {name: made[name]() for name in runners}
        with torch.inference_mode(), torch.compiler.set_stance("default", skip_guard_eval_unsafe=False):
            for call in run.values():   # as the engine runs them: inference mode (a guard of the graphs)
                call(*inputs)                     # compiles (or loads) and checks the guards once
        times: dict[str, list[float]] = {name: [] for name in runners}
        extern: dict[str, float] = {}
        with torch.inference_mode(), torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            for _ in range(rounds):
                for name, call in run.items():
                    started = time.perf_counter()
                    for _ in range(calls):
                        call(*inputs)
                    times[name].append((time.perf_counter() - started) / calls * 1e3)
            for name, call in run.items():
                with profile(activities=[ProfilerActivity.CPU]) as profiler:
                    started = time.perf_counter()
                    for _ in range(calls):
                        call(*inputs)
                    profiled_us = (time.perf_counter() - started) * 1e6
                extern[name] = sum(e.self_cpu_time_total for e in profiler.key_averages() if is_operator(e)) \
                    / profiled_us
    bound_ms = step_bytes / (bandwidth_gbs * 1e9) * 1e3
    out = []
    for name in runners:
        ordered = sorted(times[name])
        median = ordered[len(ordered) // 2]
        out.append(RunnerTiming(name, median, ordered[0], extern[name], step_bytes / median / 1e6, bound_ms / median))
    return out


def main() -> None:
    """`python bench/step_breakdown.py`: `compare_runners` for the bench MoE model per family, dtype and batch;
    prints a table and writes bench/results/step_breakdown.json."""
    import argparse
    import json
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.bench_offline import RESULTS, build_checkpoint, copy_bandwidth_gbs, weight_bytes_per_decode_step

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--kernels", nargs="+", default=["torch", "cpu"])
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="step_breakdown.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        path = str(build_checkpoint(dtype))
        dtype_bytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        for batch in args.batches:
            step_bytes = weight_bytes_per_decode_step(batch, dtype_bytes)
            for kernels in args.kernels:
                bandwidth = copy_bandwidth_gbs()
                timings = compare_runners(path, dtype, batch, kernels, step_bytes, bandwidth, args.rounds,
                                          runners=tuple(args.runners))
                load = os.getloadavg()[0]
                for t in timings:
                    rows.append(dict(dtype=dtype, batch=batch, kernels=kernels, copy_bandwidth_gbs=bandwidth,
                                     weight_bytes_per_step=step_bytes, load_avg_1m=load, **asdict(t)))
                    print(f"{dtype:9} b{batch:<3} {kernels:6} {t.runner:7} {t.step_ms:7.2f} ms (best {t.best_step_ms:.2f})"
                          f"  in extern ops {t.extern_share:4.0%}  {t.weight_gbs:5.1f} GB/s  {t.bound_fraction:4.0%} of the "
                          f"{bandwidth:.1f} GB/s bound  load {load:.1f}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(dict(
        benchmark="step_breakdown", threads=args.threads, torch=torch.__version__, rounds=args.rounds,
        command="python bench/step_breakdown.py " + " ".join(sys.argv[1:]), rows=rows), indent=2))


if __name__ == "__main__":
    main()
