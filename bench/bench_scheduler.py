"""Scheduler benchmarks on the demo model (DeepSeek-V3-style MoE with MLA, 4 layers): chunked prefill under
mixed load, and prefix caching (with cache-aware DP routing) on a shared system prompt.

- mixed: 8 streaming decoders run while prompts of 512, 1024, 1536 and 2048 tokens arrive (one every
  `--gap-s` seconds, on the schedule's clock: a request that arrives during a step waits for it, as in a
  server). Inter-token latency (p50, p99) of the decoders while the long prompts are being prefilled,
  and the long prompts' time to first token; unchunked (a prefill step holds every decoder) and chunked
  (`--chunks` tokens a step, decodes included), one engine each, one after the other in this run.
- prefix: 64 requests sharing a 1024-token system prompt, each with its own 32-token tail, all
  submitted at once, 8 new tokens each; at dp_attn 1 (one rank) and dp_attn 2 (ep=2, two worker
  processes): time to first token (p50) and total time with prefix caching off, on, and (dp_attn 2) on
  with cache-aware routing; hit rate = prefix-cache hit tokens / looked-up tokens. `--groups G` adds a
  run with G different system prompts (64 / G requests each, arriving in a shuffled order) at dp_attn 2,
  where routing matters: a least-load router spreads every prefix over both workers, a cache-aware one
  keeps each where it was first computed while the load allows.

Every engine runs its ranks on one thread each (`torch.set_num_threads(1)` here, one per worker rank);
on a 2-core machine shared with other work, more threads than cores only add contention.

    python bench/bench_scheduler.py [--parts mixed prefix] [--requests 64] [--chunks 512 128] [--groups 4]

Writes bench/results/scheduler.json and prints both tables (markdown).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_runtime.demo.demo_model import ensure_demo_model
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MAX_MODEL_LEN = 4096          # the demo's positions are rotary: longer than its 2048 is fine for timing
LONG_PROMPTS = (512, 1024, 1536, 2048)
DECODERS = 8
SYSTEM_PROMPT = 1024
TAIL = 32
NEW_TOKENS = 8

logger = logging.getLogger("bench_scheduler")


def tokens(seed: int, length: int, vocab: int = 4000) -> list[int]:
    """A deterministic pseudo-random prompt (ids 100..vocab)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (length,), generator=generator).tolist()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def engine_config(model: str, **overrides) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, **overrides)


# ---- mixed load: decoders while long prompts arrive ----------------------------------------------------------
@dataclass
class MixedResult:
    mode: str
    max_num_batched_tokens: int
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    ttft_s: dict[int, float]                  # long prompt length -> its time to first token
    decoder_tokens_in_window: int
    steps: int


def run_mixed(model: str, chunked: bool, chunk: int, gap_s: float) -> MixedResult:
    budget = chunk if chunked else 4096
    engine = make_engine(engine_config(model, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                                       enable_prefix_caching=False))
    decode = SamplingParams(max_tokens=MAX_MODEL_LEN - 64, temperature=0.0, ignore_eos=True)
    try:
        for i in range(DECODERS):
            engine.add_request(f"decoder-{i}", tokens(i, 32), decode)
        token_times: dict[str, list[float]] = {f"decoder-{i}": [] for i in range(DECODERS)}
        while min(len(t) for t in token_times.values()) < 4:     # every decoder streaming
            for out in engine.step():
                token_times[out.request_id].append(time.perf_counter())
        start = time.perf_counter() + 0.2
        arrivals = {f"long-{n}": (start + k * gap_s, n) for k, n in enumerate(LONG_PROMPTS)}
        first_token: dict[str, float] = {}
        pending = dict(arrivals)
        steps = 0
        while len(first_token) < len(arrivals):
            now = time.perf_counter()
            for request_id, (due, length) in list(pending.items()):
                if due <= now:
                    engine.add_request(request_id, tokens(1000 + length, length),
                                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                    del pending[request_id]
            outputs = engine.step()
            steps += 1
            stamp = time.perf_counter()
            for out in outputs:
                if out.request_id in token_times:
                    token_times[out.request_id].extend([stamp] * len(out.new_token_ids))
                elif out.request_id not in first_token and out.new_token_ids:
                    first_token[out.request_id] = stamp
            if not outputs and pending:
                time.sleep(min(0.01, max(0.0, min(d for d, _ in pending.values()) - time.perf_counter())))
        window = (start, max(first_token.values()))
        gaps = []
        counted = 0
        for times in token_times.values():
            inside = [t for t in times if window[0] <= t <= window[1]]
            counted += len(inside)
            gaps += [b - a for a, b in zip(inside, inside[1:])]
        for request_id in token_times:
            engine.abort(request_id)
        return MixedResult("chunked" if chunked else "unchunked", budget,
                           round(1e3 * percentile(gaps, 50), 1), round(1e3 * percentile(gaps, 99), 1),
                           round(1e3 * max(gaps), 1),
                           {arrivals[r][1]: round(t - arrivals[r][0], 3) for r, t in sorted(first_token.items())},
                           counted, steps)
    finally:
        engine.shutdown()


# ---- shared prefix: a burst of requests sharing a system prompt ------------------------------------------
@dataclass
class PrefixResult:
    dp_attn: int
    prefix_caching: bool
    cache_aware_routing: bool
    system_prompts: int
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    total_s: float
    hit_rate: float                     # prefix-cache hit tokens / tokens looked up
    requests_per_worker: list[int] = field(default_factory=list)


def run_prefix(model: str, dp: int, caching: bool, routing: bool, requests: int, groups: int = 1) -> PrefixResult:
    engine = make_engine(engine_config(model, ep=dp, dp_attn=dp, enable_prefix_caching=caching,
                                       cache_aware_routing=routing))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for i in range(dp):                                     # every worker has run a step before we time
            engine.add_request(f"warm-{i}", tokens(5000 + i, 40), warm)
        while engine.has_unfinished():
            engine.step()
        engine.reset_prefix_cache()
        before = engine.stats()
        systems = [tokens(7000 + g, SYSTEM_PROMPT) for g in range(groups)]
        group_of = [i % groups for i in range(requests)]
        random.Random(0).shuffle(group_of)                      # arrival order mixes the system prompts
        prompts = {f"r{i}": systems[group_of[i]] + tokens(9000 + i, TAIL) for i in range(requests)}
        started = time.perf_counter()
        submitted = {}
        per_worker = [0] * dp
        for request_id, prompt in prompts.items():
            submitted[request_id] = time.perf_counter()
            engine.add_request(request_id, prompt, params)
            if dp > 1:
                per_worker[engine.router.last_decision.dp_rank] += 1
        first: dict[str, float] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()
        total = time.perf_counter() - started
        after = engine.stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        ttfts = [first[r] - submitted[r] for r in prompts]
        return PrefixResult(dp, caching, routing and caching and dp > 1, groups, requests,
                            round(statistics.median(ttfts), 3), round(percentile(ttfts, 99), 3), round(total, 2),
                            round(hits / queries, 3) if queries else 0.0, per_worker if dp > 1 else [requests])
    finally:
        engine.shutdown()


# ---- report -----------------------------------------------------------------------------------------------
def mixed_table(rows: list[MixedResult]) -> str:
    header = ("| prefill | budget (tokens/step) | decoder ITL p50 | ITL p99 | ITL max | "
              + " | ".join(f"TTFT {n}" for n in LONG_PROMPTS) + " |")
    lines = [header, "|" + "---|" * (5 + len(LONG_PROMPTS))]
    for r in rows:
        ttft = " | ".join(f"{r.ttft_s[n]:.2f} s" for n in LONG_PROMPTS)
        lines.append(f"| {r.mode} | {r.max_num_batched_tokens} | {r.itl_p50_ms:.0f} ms | {r.itl_p99_ms:.0f} ms | "
                     f"{r.itl_max_ms:.0f} ms | {ttft} |")
    return "\n".join(lines)


def prefix_table(rows: list[PrefixResult]) -> str:
    lines = ["| dp_attn | system prompts | prefix caching | routing | TTFT p50 | TTFT p99 | total | hit rate | "
             "requests per worker |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        routing = "cache-aware" if r.cache_aware_routing else "least load"
        lines.append(f"| {r.dp_attn} | {r.system_prompts} | {'on' if r.prefix_caching else 'off'} | {routing} | "
                     f"{r.ttft_p50_s:.2f} s | {r.ttft_p99_s:.2f} s | {r.total_s:.1f} s | {r.hit_rate:.0%} | "
                     f"{'/'.join(map(str, r.requests_per_worker))} |")
    return "\n".join(lines)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["mixed", "prefix"], choices=["mixed", "prefix"])
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 128],
                        help="chunked prefill's token budgets per step (one run each)")
    parser.add_argument("--gap-s", type=float, default=1.5, help="seconds between long-prompt arrivals")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4, help="system prompts of the routing run (0: skip it)")
    parser.add_argument("--out", default=str(RESULTS / "scheduler.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    model = str(ensure_demo_model())
    report: dict = dict(what="scheduler: chunked prefill under mixed load; prefix caching and cache-aware DP "
                             "routing on a shared system prompt (demo model, fp32, CPU, one thread per rank)",
                        machine=dict(cpus=os.cpu_count(), threads_per_rank=torch.get_num_threads(),
                                     load_average_1m=round(os.getloadavg()[0], 2), platform=platform.machine(),
                                     python=platform.python_version(), torch=torch.__version__),
                        commit=commit())
    if "mixed" in args.parts:
        mixed = [run_mixed(model, False, 0, args.gap_s)] + [run_mixed(model, True, c, args.gap_s) for c in args.chunks]
        report["mixed"] = dict(decoders=DECODERS, long_prompts=list(LONG_PROMPTS), gap_s=args.gap_s,
                               rows=[asdict(r) for r in mixed])
        print(mixed_table(mixed), flush=True)
    if "prefix" in args.parts:
        runs = [(1, False, False, 1), (1, True, False, 1), (2, False, False, 1), (2, True, False, 1),
                (2, True, True, 1)]
        if args.groups > 1:
            runs += [(2, True, False, args.groups), (2, True, True, args.groups)]
        prefix = [run_prefix(model, dp, caching, routing, args.requests, groups)
                  for dp, caching, routing, groups in runs]
        report["prefix"] = dict(system_prompt_tokens=SYSTEM_PROMPT, tail_tokens=TAIL, new_tokens=NEW_TOKENS,
                                rows=[asdict(r) for r in prefix])
        print(prefix_table(prefix), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
