"""Decode steps with sampling inside the captured graph vs eager decode, on the bench MoE model (bench_offline's).

One process holds two engines on the same checkpoint: eager (`enable_torch_compile=False`) and captured
(AOTInductor, the CPU's default), whose steps run three ways: `graph` (the step samples in its graph and returns
token ids: execution/model_runner.py `execute_and_sample`), `host` (the same captured forward, the eager sampler
after it: `ModelRunner.sample_in_graph = False`) and the eager engine. For each batch and sampling mode
(greedy; seeded temperature 0.8 / top-k 50 / top-p 0.9) `batch` prompts are prefilled, then `steps` decode steps of
`EngineCore.step()` are timed per system, systems interleaved round by round (eager, host, graph, eager, ...)
so that other processes' load hits them alike; medians and best rounds per system and their ratios. The load
average is recorded beside them. Writes bench/results/graph_sampling.json.

    python bench/bench_graph_sampling.py [--batches 1 16] [--rounds 5] [--steps 8] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.bench_offline import RESULTS, build_checkpoint   # noqa: E402
from moe_runtime import LLM, SamplingParams                # noqa: E402

MODES = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=50, top_p=0.9)}
PROMPT_LEN = 32


def decode_step_seconds(llm: LLM, batch: int, steps: int, mode: str, tag: str) -> tuple[float, list[list[int]]]:
    """Prefill `batch` prompts, then time `steps` decode steps of the engine core (one token per sequence each);
    the tokens the steps made, per request."""
    engine, core = llm.engine, llm.core
    params = [SamplingParams(max_tokens=steps + 4, ignore_eos=True, seed=100 + i, **MODES[mode])
              for i in range(batch)]
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [(17 * i + 5 * j) % 8000 + 3 for j in range(PROMPT_LEN)], params[i])
    started: set[str] = set()
    while len(started) < batch:   # prefill to a first token
        started.update(o.request_id for o in engine.step() if o.token_ids)
    core.step()                   # one decode step unmeasured
    begun = time.perf_counter()
    for _ in range(steps):
        core.step()
    seconds = (time.perf_counter() - begun) / steps
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = list(out.token_ids)
    return seconds, [tokens.get(f"{tag}-{i}", []) for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="graph_sampling.json")
    args = parser.parse_args()
    path = str(build_checkpoint(args.dtype))
    largest = max(args.batches)
    rows = []
    with LLM(path, device="cpu", dtype=args.dtype, max_num_seqs=largest) as eager, \
            LLM(path, device="cpu", dtype=args.dtype, max_num_seqs=largest, enable_torch_compile=True,
                torch_compile_max_bs=largest) as captured:
        runner = captured.core.runner

        def run(system: str, batch: int, mode: str, tag: str):
            runner.sample_in_graph = system == "graph"
            return decode_step_seconds(eager if system == "eager" else captured, batch, args.steps, mode, tag)

        for batch in args.batches:
            for mode in args.modes:
                for system in ("host", "graph"):   # compiles (or loads) this bucket's graphs first
                    run(system, batch, mode, f"warm-{system}-{batch}-{mode}")
                times = {"eager": [], "host": [], "graph": []}
                tokens = {}
                loads = []
                for r in range(args.rounds):
                    for system in times:
                        seconds, made = run(system, batch, mode, f"{system}-{batch}-{mode}-{r}")
                        times[system].append(seconds)
                        tokens[system] = made
                    loads.append(os.getloadavg()[0])
                median = {system: statistics.median(t) for system, t in times.items()}
                best = {system: min(t) for system, t in times.items()}   # the least disturbed round of each
                row = dict(dtype=args.dtype, batch=batch, mode=mode, rounds=args.rounds, steps=args.steps,
                           step_ms={s: round(m * 1e3, 2) for s, m in median.items()},
                           tok_s={s: round(batch / m, 1) for s, m in median.items()},
                           graph_vs_eager=round(median["eager"] / median["graph"], 3),
                           host_vs_eager=round(median["eager"] / median["host"], 3),
                           graph_vs_host=round(median["host"] / median["graph"], 3),
                           best_step_ms={s: round(m * 1e3, 2) for s, m in best.items()},
                           best_graph_vs_eager=round(best["eager"] / best["graph"], 3),
                           best_graph_vs_host=round(best["host"] / best["graph"], 3),
                           same_tokens_as_eager={s: tokens[s] == tokens["eager"] for s in ("host", "graph")},
                           load_avg=[round(x, 1) for x in loads])
                rows.append(row)
                print(json.dumps(row), flush=True)
        stats = runner.capture.stats
        summary = dict(graphs_compiled=stats.graphs_compiled, graph_sampled_steps=stats.graph_sampled_steps,
                       captured_steps=stats.captured_steps)
    out = dict(rows=rows, capture=summary, threads=torch.get_num_threads(), cpus=os.cpu_count(),
               torch=torch.__version__, note="medians of interleaved rounds on a shared 2-core machine: compare "
                                             "ratios within a row, not absolute times across runs")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / args.out}")


if __name__ == "__main__":
    main()
