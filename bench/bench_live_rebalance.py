"""Live expert rebalancing end to end: decode throughput with the static placement vs after a rebalance.

On the skewed checkpoint of bench/skewed_checkpoint.py (hidden 256, 4 layers, 16 experts top-2, expert
intermediate 1024, fp32; each layer sends ~70% of its top-2 choices to 5 experts that share one rank
under the static placement), two engines with the same settings (4 redundant expert slots) per layout:
  static      never rebalances: the static placement (slot e -> expert e, redundant slots 16..19 ->
              experts 0..3) stays in force
  rebalanced  after the same warm-up, `rebalance_now()` plans from the recorded window and moves
              expert weights between ranks; the timed runs then serve on the new placement
Layouts: ep=4 dp_attn=4 (4 ranks on this machine's 2 cores, which mutes the straggler)
and ep=2 dp_attn=2 (one rank per core, where a straggler rank costs wall time as it would on GPUs).
Repeats alternate between the two engines, in ABBA order (so load from other processes and any
order effect hit both alike); best and median repeats are reported. Per engine: tokens/s (prefill included) and decode tokens/s, the measured
per-rank expert load of the timed runs (tokens each rank's experts computed, from the recorder's
physical-slot counts: balancedness = mean/max per layer, averaged over layers, and max/mean), the
share of step time each rank spends in dispatch + combine (where a rank waits for the straggler),
the rebalance event (experts moved, duration, balancedness before/after on its planning window),
and whether the greedy tokens of the two engines are identical.

Then records an expert-load trace from the runtime into bench/traces/recorded.json (the
load_balancer trace format) for bench/bench_rebalance.py: the engine exposes the recorder's
window only as sums (`expert_load()`), so the front takes a snapshot after every batch of
outputs while a workload of two waves of prompts runs; each trace row is the difference of the
cumulative per-expert totals between consecutive snapshots: the tokens of the one or few
lock-step steps the ranks ran in between (summed over ranks); the trace is recorded at the first
layout. The step count of every row is written to bench/results/live_rebalance.json.

    python bench/bench_live_rebalance.py            # full run (< 5 min on 2 cores)
    python bench/bench_live_rebalance.py --quick    # smoke run, ep=4 only (replaces neither results nor trace)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_ep_decode import StepTime, TimedRun, make_prompts, timed_generate
from bench.skewed_checkpoint import SkewedShape, SkewSpec, build_skewed_checkpoint
from moe_runtime.load_balancer import (
                ExpertLoadTrace,
                Placement,
                balancedness,
                max_over_mean,
                mean_over_max,
                save_trace,
            )

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TRACE = HERE / "traces" / "recorded.json"
RECORD_WINDOW = 4096  # steps: more than a run takes, so window sums are cumulative and deltas exact

logger = logging.getLogger("bench_live_rebalance")


@dataclass
class LoadSpan:
    """Expert load of the ranks over a span of steps (difference of two snapshots)."""

    expert_counts: torch.Tensor  # [L, E] tokens per logical expert, summed over ranks
    rank_load: torch.Tensor      # [L, W] tokens computed by each rank's experts (physical slots)
    placement: torch.Tensor      # [L, P] phy2log in force at the end of the span

    @classmethod
    def between(cls, before, after) -> LoadSpan:
        """From two ExpertLoadSnapshot taken while the recorder's window still held every step."""
        for snapshot in (before, after):
            if snapshot.window != snapshot.steps:
                raise RuntimeError(f"the recorder window ({snapshot.window} steps) no longer holds all "
                                   f"{snapshot.steps} steps: raise RECORD_WINDOW")
        return cls(after.totals - before.totals, after.rank_load - before.rank_load, after.placement)

    def measured_balancedness(self) -> float:
        """mean / max of the measured per-rank load, averaged over layers."""
        return float(mean_over_max(self.rank_load).mean())

    def max_over_mean(self) -> float:
        return float(max_over_mean(self.rank_load).mean())

    def planned_balancedness(self, num_ranks: int) -> float:
        """The same logical load under the placement with tokens split evenly over replicas (the planner's model)."""
        placement = Placement.from_phy2log(self.placement, self.expert_counts.shape[1], num_ranks)
        return float(balancedness(self.expert_counts.double(), placement).mean())

    def hot_rank_share(self) -> float:
        """Share of all expert tokens taken by the busiest rank of each layer, averaged over layers."""
        total = self.rank_load.sum(-1).clamp(min=1)
        return float((self.rank_load.max(-1).values / total).mean())


@dataclass
class VariantResult:
    variant: str
    tok_s: float                     # best repeat
    tok_s_median: float
    decode_tok_s: float              # best repeat
    tok_s_all: list[float]
    balancedness_measured: float     # timed runs, per-rank tokens from physical-slot counts
    balancedness_planned: float      # timed runs' logical load under the placement (even replica split)
    rank_load_max_over_mean: float
    hot_rank_share: float
    rank_load_per_layer: list[list[float]]
    comm_share_per_rank: list[float]  # dispatch + combine / step time, per DP worker (its first rank)
    step_ms_per_rank: list[float]     # mean forward-step wall time, per DP worker (its first rank)
    ratio_vs_static: float = 1.0
    median_ratio_vs_static: float = 1.0


@dataclass
class TraceRecording:
    path: str
    rows: int
    steps_per_row: list[int] = field(default_factory=list)
    tokens: int = 0


@dataclass
class EngineMark:
    """What the engine reports at one instant between runs: expert load and DP workers' step times."""

    load: object                 # load_balancer.ExpertLoadSnapshot, summed over ranks
    workers: list[StepTime]      # per DP worker, cumulative

    @classmethod
    def take(cls, engine) -> EngineMark:
        load = engine.wait(engine.expert_load())
        workers = [StepTime(w.steps, w.step_seconds, w.moe_comm_seconds) for w in engine.stats().workers]
        return cls(load, workers)

    def since(self, earlier: EngineMark) -> tuple[LoadSpan, list[StepTime]]:
        """The expert load and each DP worker's step time between `earlier` and this mark."""
        return LoadSpan.between(earlier.load, self.load), [a - b for a, b in zip(self.workers, earlier.workers)]


def record_trace(engine, waves: list[list[list[int]]], params, path: Path, num_slots: int, num_ranks: int
                 ) -> TraceRecording:
    """Snapshot the expert load after every batch of outputs while `waves` of prompts run one after another;
    save the per-interval differences of the cumulative totals as an ExpertLoadTrace."""
    rows, steps_per_row = [], []
    previous = engine.wait(engine.expert_load())
    for wave_index, prompts in enumerate(waves):
        request_ids = [f"trace-{wave_index}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(request_ids, prompts):
            engine.add_request(request_id, prompt, params)
        pending = set(request_ids)
        while pending:
            for output in engine.step():
                if output.finished:
                    pending.discard(output.request_id)
            snapshot = engine.wait(engine.expert_load())
            if snapshot.steps > previous.steps:
                rows.append(snapshot.totals - previous.totals)  # [L, E]
                steps_per_row.append(snapshot.steps - previous.steps)
                previous = snapshot
    trace = ExpertLoadTrace(torch.stack(rows).long(), num_slots, num_ranks)  # [S, L, E]
    path.parent.mkdir(parents=True, exist_ok=True)
    save_trace(path, trace)
    return TraceRecording(str(path), len(rows), steps_per_row, int(trace.steps.sum()))


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    warmup_prompts: list[list[int]]
    params: object                   # SamplingParams of the timed runs
    warmup: object                   # SamplingParams of the warm-up the rebalance plans from
    kv_bytes: int


@dataclass
class LayoutReport:
    ep: int
    dp_attn: int
    rows: list[VariantResult]
    rebalance_event: dict
    warmup_balancedness_static: float
    identical_tokens: str
    notes: list[str]
    seconds: float
    trace: TraceRecording | None = None

    @property
    def name(self) -> str:
        return f"ep={self.ep} dp_attn={self.dp_attn}"


def summarize(variant: str, runs: list[TimedRun], spans: list[LoadSpan], step_times: list[StepTime], ep: int
              ) -> VariantResult:
    total = LoadSpan(sum(s.expert_counts for s in spans), sum(s.rank_load for s in spans), spans[-1].placement)
    tok_s = sorted(r.tok_s for r in runs)
    return VariantResult(
        variant=variant, tok_s=tok_s[-1], tok_s_median=tok_s[len(tok_s) // 2],
        decode_tok_s=max(r.decode_tok_s for r in runs), tok_s_all=[r.tok_s for r in runs],
        balancedness_measured=total.measured_balancedness(), balancedness_planned=total.planned_balancedness(ep),
        rank_load_max_over_mean=total.max_over_mean(), hot_rank_share=total.hot_rank_share(),
        rank_load_per_layer=total.rank_load.tolist(), comm_share_per_rank=[d.comm_share for d in step_times],
        step_ms_per_rank=[1e3 * d.step_seconds / max(d.steps, 1) for d in step_times],
    )


def bench_layout(ep: int, dp_attn: int, args, path: str, work: Workload, trace_path: Path | None) -> LayoutReport:
    """Static vs rebalanced engines of one layout, repeats interleaved; optionally record a trace after."""
    from moe_runtime import LLM

    shape = SkewedShape()
    variants = ["static", "rebalanced"]
    engines: dict[str, LLM] = {}
    runs: dict[str, list[TimedRun]] = {v: [] for v in variants}
    spans: dict[str, list[LoadSpan]] = {v: [] for v in variants}
    step_times: dict[str, list[StepTime]] = {}
    notes: list[str] = []
    recording = None
    started = time.perf_counter()
    try:
        for variant in variants:
            logger.info("ep=%d dp_attn=%d: starting the %s engine (%d redundant slots)", ep, dp_attn, variant,
                        args.redundant)
            llm = LLM(path, device="cpu", dtype="float32", ep=ep, dp_attn=dp_attn, num_redundant_experts=args.redundant,
                      eplb_interval=0, eplb_window=RECORD_WINDOW, eplb_layers_per_step=args.layers_per_step,
                      max_num_seqs=len(work.prompts), kv_cache_memory=work.kv_bytes)
            engines[variant] = llm
            start = EngineMark.take(llm.engine)
            timed_generate(llm.engine, work.warmup_prompts, work.warmup, "warmup")
            span, _ = EngineMark.take(llm.engine).since(start)
            if variant == "rebalanced":
                before_rebalance = span
                event = llm.rebalance_now()
                logger.info("rebalance: ok=%s, %d experts moved in %.3fs, balancedness %.3f -> %.3f (planning window)",
                            event.ok, event.experts_moved, event.duration_s, event.balancedness_before,
                            event.balancedness_after)
                if not event.ok:
                    raise RuntimeError(f"rebalance failed at ep={ep}: {event.error}")
        timed_started = time.perf_counter()
        for repeat in range(args.repeats):
            if repeat and time.perf_counter() - timed_started > args.budget_s:
                notes.append(f"stopped after {repeat} of {args.repeats} repeats: --budget-s {args.budget_s:g} spent")
                logger.warning(notes[-1])
                break
            for variant in variants if repeat % 2 == 0 else variants[::-1]:  # ABBA: no engine always goes first
                engine = engines[variant].engine
                start = EngineMark.take(engine)
                run = timed_generate(engine, work.prompts, work.params, f"r{repeat}-{variant}")
                span, deltas = EngineMark.take(engine).since(start)
                runs[variant].append(run)
                spans[variant].append(span)
                previous = step_times.get(variant, [StepTime() for _ in deltas])
                step_times[variant] = [d + p for d, p in zip(deltas, previous)]
                logger.info("ep=%d repeat %d/%d %s: %.1f tok/s (decode %.1f), balancedness %.3f", ep, repeat + 1,
                            args.repeats, variant, run.tok_s, run.decode_tok_s, span.measured_balancedness())
        if trace_path is not None:
            logger.info("recording an expert-load trace on the static engine -> %s", trace_path)
            half = max(len(work.prompts) // 2, 1)
            waves = [make_prompts(half, len(work.prompts[0]), shape.vocab_size, seed=2 + w) for w in range(2)]
            recording = record_trace(engines["static"].engine, waves, work.params, trace_path,
                                     shape.num_experts + args.redundant, ep)
    finally:
        for llm in engines.values():
            llm.shutdown()

    results = {v: summarize(v, runs[v], spans[v], step_times[v], ep) for v in variants}
    static, rebalanced = results["static"], results["rebalanced"]
    for result in results.values():
        result.ratio_vs_static = result.tok_s / static.tok_s
        result.median_ratio_vs_static = result.tok_s_median / static.tok_s_median
    same = sum(a == b for a, b in zip(runs["static"][-1].tokens, runs["rebalanced"][-1].tokens))
    cores = os.cpu_count() or 1
    if ep > cores:
        bound = max(static.hot_rank_share * cores, 1.0)
        notes.append(f"{ep} ranks share {cores} cores: even balanced ranks take turns on the cores, so evening "
                     f"out the load can shorten the expert compute of a step by at most busiest-rank share x cores "
                     f"= {bound:.2f}x here, not by the static max/mean of {static.rank_load_max_over_mean:.2f}x it "
                     f"would with one device per rank; the per-rank load is the figure that carries over")
    expected = (1 + 1 / ep) / 2
    if static.balancedness_measured > expected:
        notes.append(f"the static placement measured balancedness {static.balancedness_measured:.2f} at ep={ep}: "
                     f"the routing is not as skewed as intended (expected < {expected:.2f})")
    if min(rebalanced.ratio_vs_static, rebalanced.median_ratio_vs_static) < 1.05:
        notes.append("rebalancing did not raise throughput measurably here (see the per-rank load for what changed): "
                     "on CPU at decode batch sizes a local expert call costs mostly a fixed read of its weights "
                     "(every local expert gets a few tokens each step under either placement), and attention, "
                     "dispatch and Python overhead take most of the step, so the straggler's extra tokens are a "
                     "small part of the step time")
    return LayoutReport(ep, dp_attn, [static, rebalanced], event.to_dict(), before_rebalance.measured_balancedness(),
                        f"{same}/{len(work.prompts)}", notes, time.perf_counter() - started, recording)


def print_report(report: LayoutReport, args) -> None:
    shape, cores = SkewedShape(), os.cpu_count() or 1
    print(f"\nLive rebalance, skewed Qwen3-MoE (hidden {shape.hidden_size}, {shape.num_hidden_layers} layers, "
          f"{shape.num_experts} experts top-{shape.num_experts_per_tok}, fp32), {report.name}, "
          f"{args.redundant} redundant slots, {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new "
          f"(greedy), {cores} cores, {len(report.rows[0].tok_s_all)} repeats")
    header = (f"{'placement':11} {'best tok/s':>10} {'vs static':>10} {'median':>8} {'vs static':>10} "
              f"{'decode tok/s':>13} {'balancedness':>13} {'planned':>8} {'max/mean':>9} {'busiest rank':>13} "
              f"{'step ms':>8} {'comm share per rank':>24}")
    print(header)
    print("-" * len(header))
    for v in report.rows:
        shares = " ".join(f"{c:.0%}" for c in v.comm_share_per_rank)
        print(f"{v.variant:11} {v.tok_s:>10.1f} {v.ratio_vs_static:>9.2f}x {v.tok_s_median:>8.1f} "
              f"{v.median_ratio_vs_static:>9.2f}x {v.decode_tok_s:>13.1f} {v.balancedness_measured:>13.3f} "
              f"{v.balancedness_planned:>8.3f} {v.rank_load_max_over_mean:>9.2f} {v.hot_rank_share:>12.0%} "
              f"{sum(v.step_ms_per_rank) / len(v.step_ms_per_rank):>8.1f} {shares:>24}")
    event = report.rebalance_event
    print(f"rebalance ({event['trigger']}): {event['experts_moved']} expert weights moved in "
          f"{event['duration_s'] * 1e3:.0f} ms; balancedness on its planning window "
          f"{event['balancedness_before']:.3f} -> {event['balancedness_after']:.3f} "
          f"(warm-up measured under static: {report.warmup_balancedness_static:.3f})")
    print(f"greedy tokens identical, static vs rebalanced: {report.identical_tokens}")
    if report.trace is not None:
        print(f"trace: {report.trace.rows} rows ({sum(report.trace.steps_per_row)} lock-step steps, "
              f"{report.trace.tokens} expert choices) -> {report.trace.path}")
    for note in report.notes:
        print(f"note: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: few prompts and tokens, one repeat, ep=4 only")
    parser.add_argument("--layouts", nargs="+", default=["4x4", "2x2"],
                        help="EPxDP_ATTN layouts; the first also records the trace")
    parser.add_argument("--redundant", type=int, default=4, help="num_redundant_experts (extra slots for replicas)")
    parser.add_argument("--layers-per-step", type=int, default=0,
                        help="eplb_layers_per_step: MoE layers whose weights move per step (0 = all in one step)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--warmup-tokens", type=int, default=16, help="new tokens per prompt of the warm-up the plan uses")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="per layout: start no further repeat once the timed repeats took this long (>= 1 runs)")
    parser.add_argument("--out", default=None, help="default: bench/results/live_rebalance.json (--quick: bench/.cache/)")
    parser.add_argument("--trace", default=None, help="default: bench/traces/recorded.json (--quick: bench/.cache/)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.warmup_tokens, args.repeats = 8, 8, 4, 4, 1
        args.layouts = args.layouts[:1]
    try:
        layouts = [tuple(map(int, spec.split("x"))) for spec in args.layouts]
        if any(len(layout) != 2 for layout in layouts):
            raise ValueError
    except ValueError:
        parser.error(f"--layouts {args.layouts}: each must be EPxDP_ATTN, e.g. 4x4 2x2")
    cache = HERE / ".cache"
    args.out = args.out or str(cache / "live_rebalance.quick.json" if args.quick else RESULTS / "live_rebalance.json")
    args.trace = args.trace or str(cache / "recorded.quick.json" if args.quick else TRACE)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("moe_runtime", "load_balancer", "attention_dp", "dispatch"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from moe_runtime import SamplingParams

    shape, skew = SkewedShape(), SkewSpec()
    path = str(build_skewed_checkpoint(shape, skew))
    work = Workload(
        prompts=make_prompts(args.prompts, args.prompt_len, shape.vocab_size, seed=0),
        warmup_prompts=make_prompts(args.prompts, args.prompt_len, shape.vocab_size, seed=1),
        params=SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
        warmup=SamplingParams(max_tokens=args.warmup_tokens, temperature=0.0, ignore_eos=True),
        kv_bytes=4 * 2**20 + 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 4
        * args.prompts * (args.prompt_len + max(args.new_tokens, args.warmup_tokens) + 16),
    )
    started = time.perf_counter()
    load_at_start = os.getloadavg()[0]  # other processes on the machine: the figures are only as quiet as this
    reports = []
    for index, (ep, dp_attn) in enumerate(layouts):
        reports.append(bench_layout(ep, dp_attn, args, path, work, Path(args.trace) if index == 0 else None))
    for report in reports:
        print_report(report, args)
    print("\nbalancedness = mean/max of tokens per rank (measured from physical-slot counts over the timed runs), "
          "layer mean; planned = the same logical load under the placement, replicas splitting evenly; "
          "busiest rank = its share of all expert tokens; step ms = forward-step wall time, mean over DP workers; "
          "comm share = dispatch + combine / step time")
    print(f"machine load (1-min average, {os.cpu_count()} cores): {load_at_start:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "live_rebalance", "shape": asdict(shape), "skew": asdict(skew), "dtype": "float32",
        "num_redundant_experts": args.redundant, "eplb_layers_per_step": args.layers_per_step,
        "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "warmup_tokens": args.warmup_tokens, "repeats": args.repeats, "quick": args.quick, "cores": os.cpu_count(),
        "machine": platform.machine(), "python": sys.version.split()[0], "torch": torch.__version__,
        "load_average_1m": {"start": load_at_start, "end": os.getloadavg()[0]},
        "layouts": [asdict(report) for report in reports], "seconds": time.perf_counter() - started,
        "command": "python bench/bench_live_rebalance.py" + (" --quick" if args.quick else ""),
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
