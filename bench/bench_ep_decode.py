"""End-to-end decode throughput with expert parallelism: ep=2 / ep=4 (DP attention) vs one rank, same cores.

On the Qwen3-MoE bench checkpoint of bench_offline.py (hidden 512, 8 layers, 32 experts top-4, fp32),
each layout generates for the same prompts (16 x 32 tokens, 32 new, greedy, eos ignored):
  ep=1 (N thr)    one in-process engine using every core (what a user runs without EP): the baseline
  ep=1 (1 thr)    the same engine on one intra-op thread (the per-core figure; also shows when the
                  machine is busy, since OpenMP threads then wait on each other)
  ep=2 dp_attn=2  two worker ranks, each its own DP attention worker, experts split in two
  ep=4 dp_attn=4  four worker ranks (more ranks than cores here: an oversubscription figure)
All engines are started first; repeats then alternate between them, forward and backward in turn,
so that load from other processes on the machine and any order effect hit every layout alike.

Reported per layout: generated tokens/s over the whole request (prefill included; best and median
repeat), decode tokens/s (after every request has its first token; best repeat), the ratios to the
baseline, the share of forward-step time spent in dispatch + combine (WorkerStats.moe_comm_seconds /
step_seconds, deltas over the timed runs, summed over DP workers), and whether the greedy tokens
equal the baseline's. Writes bench/results/ep_decode.json.

    python bench/bench_ep_decode.py            # full run (< 5 min on 2 cores)
    python bench/bench_ep_decode.py --quick    # smoke run: 4 prompts x 8 tokens, 4 new, ep 1 (2 and 1 threads) and 2
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

from bench.bench_offline import SHAPE, build_checkpoint

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

logger = logging.getLogger("bench_ep_decode")


@dataclass(frozen=True)
class Layout:
    ep: int
    dp_attn: int
    threads: int | None = None  # intra-op threads of the in-process ep=1 engine (None: every core)

    @classmethod
    def parse(cls, spec: str) -> Layout:
        """'EPxDP' or, for ep=1, '1x1tN' (N intra-op threads)."""
        try:
            parallel, _, threads = spec.partition("t")
            ep, dp_attn = map(int, parallel.split("x"))
            layout = cls(ep, dp_attn, int(threads) if threads else None)
        except ValueError:
            raise ValueError(f"--layouts: {spec!r} is not EPxDP_ATTN (e.g. 2x2) or 1x1tTHREADS") from None
        if layout.threads is not None and ep != 1:
            raise ValueError(f"--layouts: {spec!r}: a thread count applies to ep=1 only (ranks get cores / ep)")
        return layout

    @property
    def name(self) -> str:
        if self.ep == 1:
            return f"ep=1 ({self.threads or os.cpu_count()} thr)"
        return f"ep={self.ep} dp_attn={self.dp_attn}"


@dataclass
class TimedRun:
    """One batch of requests submitted together and run to completion."""

    tokens: list[list[int]]       # generated ids per prompt, in prompt order
    seconds: float                # submit -> last token
    first_token_seconds: float    # submit -> every request has its first token (the prefill)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tok_s(self) -> float:
        return self.generated / self.seconds

    @property
    def decode_tok_s(self) -> float:
        """Tokens after each request's first, per second after the last first token arrived."""
        decode_tokens = self.generated - len(self.tokens)
        return decode_tokens / max(self.seconds - self.first_token_seconds, 1e-9)


@dataclass
class StepTime:
    """Forward-step time of a layout summed over its DP workers (deltas over a span)."""

    steps: int = 0
    step_seconds: float = 0.0
    moe_comm_seconds: float = 0.0

    @classmethod
    def of(cls, engine) -> StepTime:
        workers = engine.stats().workers
        return cls(sum(w.steps for w in workers), sum(w.step_seconds for w in workers),
                   sum(w.moe_comm_seconds for w in workers))

    def __sub__(self, other: StepTime) -> StepTime:
        return StepTime(self.steps - other.steps, self.step_seconds - other.step_seconds,
                        self.moe_comm_seconds - other.moe_comm_seconds)

    def __add__(self, other: StepTime) -> StepTime:
        return StepTime(self.steps + other.steps, self.step_seconds + other.step_seconds,
                        self.moe_comm_seconds + other.moe_comm_seconds)

    @property
    def comm_share(self) -> float:
        return self.moe_comm_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


@dataclass
class LayoutResult:
    layout: str
    ep: int
    dp_attn: int
    tok_s: float                 # best repeat
    decode_tok_s: float          # best repeat
    tok_s_all: list[float]
    tok_s_median: float = 0.0
    ratio_vs_ep1: float = 1.0    # tok_s / ep=1's tok_s
    median_ratio_vs_ep1: float = 1.0
    decode_ratio_vs_ep1: float = 1.0
    comm_share: float = 0.0      # dispatch + combine / forward-step time, all timed repeats
    steps_per_repeat: float = 0.0
    identical_to_ep1: str = ""   # "same/prompts" of the last repeat
    start_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def timed_generate(engine, prompts: list[list[int]], params, prefix: str) -> TimedRun:
    """Submit every prompt at once, step the engine until all finish, time first tokens and the end."""
    request_ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    started = time.perf_counter()
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    first_token_at = None
    while len(finished) < len(request_ids):
        for output in engine.step():
            tokens[output.request_id] = list(output.token_ids)
            if output.finished:
                finished.add(output.request_id)
        if first_token_at is None and len(tokens) == len(request_ids):
            first_token_at = time.perf_counter() - started
    seconds = time.perf_counter() - started
    return TimedRun([tokens[r] for r in request_ids], seconds, first_token_at or seconds)


def make_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (count, length), generator=generator).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 prompts x 8 tokens, 4 new, ep 1 (2 and 1 threads) and 2")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="start no further repeat once the timed repeats have taken this long (>= 1 repeat runs)")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x1t1", "2x2", "4x4"],
                        help="EPxDP_ATTN (2x2, 4x2), or 1x1tN for one rank with N threads; the first is the baseline")
    parser.add_argument("--out", default=None, help="default: bench/results/ep_decode.json "
                        "(--quick: bench/.cache/ep_decode.quick.json, so a smoke run never replaces results)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.repeats, args.layouts = 4, 8, 4, 1, ["1x1", "1x1t1", "2x2"]
    args.out = args.out or str(HERE / ".cache" / "ep_decode.quick.json" if args.quick else RESULTS / "ep_decode.json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("moe_runtime").setLevel(logging.WARNING)
    try:
        layouts = [Layout.parse(spec) for spec in args.layouts]
    except ValueError as exc:
        parser.error(str(exc))
    if layouts[0].ep != 1:
        parser.error("--layouts must start with an ep=1 layout (the baseline the ratios are taken against)")

    from moe_runtime import LLM, SamplingParams

    path = str(build_checkpoint("float32"))
    prompts = make_prompts(args.prompts, args.prompt_len, SHAPE["vocab_size"])
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    warmup = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    kv_bytes = 4 * 2**20 + 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 4 \
        * args.prompts * (args.prompt_len + args.new_tokens + 16)

    budget_note = None
    load_at_start = os.getloadavg()[0]  # other processes on the machine: the figures are only as quiet as this
    engines, results = {}, {}  # engines keyed by (ep, dp_attn): the ep=1 rows share one in-process engine
    default_threads = torch.get_num_threads()
    try:
        for layout in layouts:
            started = time.perf_counter()
            key = (layout.ep, layout.dp_attn)
            if key not in engines:
                logger.info("starting %s", layout.name)
                engines[key] = LLM(path, device="cpu", dtype="float32", ep=layout.ep, dp_attn=layout.dp_attn,
                                   max_num_seqs=args.prompts, kv_cache_memory=kv_bytes)
                timed_generate(engines[key].engine, prompts, warmup, f"warmup-{layout.ep}x{layout.dp_attn}")
            results[layout] = LayoutResult(layout.name, layout.ep, layout.dp_attn, 0.0, 0.0, [],
                                           start_seconds=time.perf_counter() - started)
        runs: dict[Layout, list[TimedRun]] = {layout: [] for layout in layouts}
        step_time: dict[Layout, StepTime] = {layout: StepTime() for layout in layouts}
        timed_started = time.perf_counter()
        for repeat in range(args.repeats):
            if repeat and time.perf_counter() - timed_started > args.budget_s:
                budget_note = f"stopped after {repeat} of {args.repeats} repeats: --budget-s {args.budget_s:g} spent"
                logger.warning(budget_note)
                break
            for layout in layouts if repeat % 2 == 0 else layouts[::-1]:  # no layout always runs first
                engine = engines[(layout.ep, layout.dp_attn)].engine
                torch.set_num_threads(layout.threads or default_threads)
                before = StepTime.of(engine)
                run = timed_generate(engine, prompts, params, f"r{repeat}-{layout.ep}x{layout.dp_attn}-{layout.threads}")
                step_time[layout] += StepTime.of(engine) - before
                runs[layout].append(run)
                logger.info("repeat %d/%d %s: %.1f tok/s (decode %.1f tok/s)", repeat + 1, args.repeats,
                            layout.name, run.tok_s, run.decode_tok_s)
    finally:
        torch.set_num_threads(default_threads)
        for llm in engines.values():
            llm.shutdown()

    baseline = results[layouts[0]]
    reference_tokens = runs[layouts[0]][-1].tokens
    for layout in layouts:
        r = results[layout]
        r.tok_s_all = [run.tok_s for run in runs[layout]]
        r.tok_s = max(r.tok_s_all)
        r.tok_s_median = sorted(r.tok_s_all)[len(r.tok_s_all) // 2]
        r.decode_tok_s = max(run.decode_tok_s for run in runs[layout])
        r.comm_share = step_time[layout].comm_share
        r.steps_per_repeat = step_time[layout].steps / len(runs[layout])
        same = sum(a == b for a, b in zip(runs[layout][-1].tokens, reference_tokens))
        r.identical_to_ep1 = f"{same}/{len(prompts)}"
        if layout.ep > (os.cpu_count() or 1):
            r.notes.append(f"{layout.ep} ranks on {os.cpu_count()} cores: oversubscribed")
    for layout in layouts:
        r = results[layout]
        r.ratio_vs_ep1 = r.tok_s / baseline.tok_s
        r.median_ratio_vs_ep1 = r.tok_s_median / baseline.tok_s_median
        r.decode_ratio_vs_ep1 = r.decode_tok_s / baseline.decode_tok_s
    notes = [budget_note] if budget_note else []
    one_thread = [results[layout] for layout in layouts if layout.ep == 1 and layout.threads == 1]
    if one_thread and baseline is not one_thread[0] and one_thread[0].tok_s > 1.5 * baseline.tok_s:
        notes.append(f"{baseline.layout} ran {one_thread[0].tok_s / baseline.tok_s:.1f}x slower than ep=1 on one "
                     f"thread: the cores were busy with other processes and its OpenMP threads waited on each "
                     f"other; rerun on a quiet machine before quoting the ep=1 ratios")

    print(f"\nEnd-to-end generation, Qwen3-MoE bench shape (fp32), {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.new_tokens} new (greedy), {os.cpu_count()} cores, {len(runs[layouts[0]])} repeats (best, median)")
    header = (f"{'layout':16} {'tok/s':>8} {'vs ep=1':>8} {'median':>8} {'vs ep=1':>8} {'decode tok/s':>13} "
              f"{'vs ep=1':>8} {'dispatch+combine':>17} {'same tokens':>12} {'start s':>8}")
    print(header)
    print("-" * len(header))
    for layout in layouts:
        r = results[layout]
        print(f"{r.layout:16} {r.tok_s:>8.1f} {r.ratio_vs_ep1:>7.2f}x {r.tok_s_median:>8.1f} "
              f"{r.median_ratio_vs_ep1:>7.2f}x {r.decode_tok_s:>13.1f} "
              f"{r.decode_ratio_vs_ep1:>7.2f}x {r.comm_share:>16.0%} {r.identical_to_ep1:>12} {r.start_seconds:>8.1f}")
    print("dispatch+combine: share of forward-step time in WorkerStats.moe_comm_seconds, summed over DP workers")
    print(f"machine load (1-min average, {os.cpu_count()} cores): {load_at_start:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    for note in notes:
        print(f"note: {note}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "ep_decode", "shape": SHAPE, "dtype": "float32", "prompts": args.prompts, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "quick": args.quick, "cores": os.cpu_count(),
        "machine": platform.machine(), "python": sys.version.split()[0], "torch": torch.__version__,
        "load_average_1m": {"start": load_at_start, "end": os.getloadavg()[0]},
        "rows": [asdict(results[layout]) for layout in layouts], "notes": notes,
        "command": "python bench/bench_ep_decode.py" + (" --quick" if args.quick else ""),
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
