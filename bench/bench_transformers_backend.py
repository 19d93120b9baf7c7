"""The transformers backend (`--model-impl transformers`: transformers' modeling code with our paged attention
and MoE executor) against the native ports, on the Qwen3-MoE and DeepSeek-V3 shaped bench checkpoints.

Both engines of a model live in this one process (one rank each, CPU, float32, prefix caching off so every
prefill is computed) and are timed in interleaved rounds (the order alternates per round), so the shared
machine's load falls on both alike. Each round generates 1 + `--new-tokens` tokens per prompt for each batch
size, driving the front step by step: the prefill rate is the prompt tokens over the time to the step that
gives every first token (one step: the batch's prompts fit one step), the decode rate the median over the
decode steps of the tokens a step gives over its time (a median, so a burst of load from other jobs moves it
little). Both rates also per CPU second of this process (`*_cpu`: process time, every thread's), which the
load of other jobs moves far less than wall time. Medians over the rounds, and generic / native ratios.
Greedy tokens of the two implementations are compared (`tokens_equal`). A model the generic path cannot build or
run is reported with the reason. The load average before and after is recorded: the machine is shared.

    python bench/bench_transformers_backend.py [--rounds 3] [--batches 1 4] [--new-tokens 8]
        [--models qwen3moe deepseekv3]

Writes bench/results/transformers_backend.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.bench_offline import build_checkpoint as build_qwen3moe_checkpoint
from bench.deepseek_mtp_checkpoint import SHAPE as DEEPSEEK_SHAPE
from bench.random_checkpoint import save_random_checkpoint

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results"
PROMPT_LEN = 64
IMPLS = ("native", "transformers")
REQUEST_IDS = itertools.count()
PHASES = ("prefill", "decode", "prefill_cpu", "decode_cpu")   # *_cpu: tokens per CPU second of this process

logger = logging.getLogger("bench_transformers_backend")


def deepseekv3_checkpoint() -> Path:
    """DeepSeek-V3's shape scaled down (bench/deepseek_mtp_checkpoint.py's, without the MTP layer)."""
    path = CACHE / "deepseekv3-bench-float32"
    if (path / "config.json").exists():
        return path
    from transformers import DeepseekV3Config

    return save_random_checkpoint(DeepseekV3Config(**DEEPSEEK_SHAPE, initializer_range=0.05), "DeepseekV3ForCausalLM",
                                  path)


CHECKPOINTS = {"qwen3moe": lambda: build_qwen3moe_checkpoint("float32"), "deepseekv3": deepseekv3_checkpoint}


def prompts(batch: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(100, min(vocab, 4096), (batch, PROMPT_LEN), generator=generator).tolist()


@dataclass
class Timed:
    """One generation, timed on the wall clock and in this process's CPU time (every thread's: the engine runs
    in this process), which a shared machine's load moves far less than wall time."""

    prefill_s: float               # to the step giving the first tokens
    prefill_cpu_s: float
    decode_rates: list[float]      # each later step's tokens / s
    decode_cpu_rates: list[float]  # each later step's tokens / CPU second
    tokens: list[list[int]]


def timed_generate(llm, batch_prompts, max_tokens: int) -> Timed:
    from moe_runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    front = llm.engine
    ids = [f"bench-{next(REQUEST_IDS)}" for _ in batch_prompts]
    started, started_cpu = time.perf_counter(), time.process_time()
    for request_id, prompt in zip(ids, batch_prompts):
        front.add_request(request_id, prompt, params)
    events, finished = [], {}
    while len(finished) < len(ids):
        outputs = front.step()
        tokens = sum(len(o.new_token_ids) for o in outputs)
        if tokens:
            events.append((time.perf_counter(), time.process_time(), tokens))
        finished.update((o.request_id, o.token_ids) for o in outputs if o.finished)
    pairs = list(zip(events, events[1:]))
    return Timed(events[0][0] - started, events[0][1] - started_cpu,
                 [n / (t - t0) for (t0, _, _), (t, _, n) in pairs],
                 [n / max(c - c0, 1e-9) for (_, c0, _), (_, c, n) in pairs], [finished[r] for r in ids])


def open_engines(path: Path, batches: list[int]) -> tuple[dict, dict]:
    """impl -> its LLM, and impl -> why it could not start (the generic path may refuse a model)."""
    from moe_runtime import LLM

    engines, failures = {}, {}
    for impl in IMPLS:
        try:
            engines[impl] = LLM(str(path), device="cpu", dtype="float32", model_impl=impl,
                                max_num_seqs=max(batches), enable_prefix_caching=False)
        except Exception as exc:   # recorded in the results: the reason is the finding
            failures[impl] = f"{type(exc).__name__}: {exc}"
            logger.warning("%s: %s could not start: %s", path.name, impl, failures[impl])
    return engines, failures


def measure_model(name: str, rounds: int, batches: list[int], new_tokens: int) -> dict:
    path = CHECKPOINTS[name]()
    config = json.loads((path / "config.json").read_text())
    engines, failures = open_engines(path, batches)
    samples = {(impl, b): {phase: [] for phase in PHASES} for impl in engines for b in batches}
    tokens = {}
    try:
        for impl, llm in list(engines.items()):   # warm-up, and a first run that may fail
            try:
                timed_generate(llm, prompts(batches[0], config["vocab_size"]), 4)
            except Exception as exc:
                failures[impl] = f"{type(exc).__name__}: {exc}"
                engines.pop(impl).shutdown()
        for r in range(rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for batch in batches:
                batch_prompts = prompts(batch, config["vocab_size"])
                for impl in order:
                    llm = engines[impl]
                    timed = timed_generate(llm, batch_prompts, 1 + new_tokens)
                    sample = samples[(impl, batch)]
                    sample["prefill"].append(batch * PROMPT_LEN / timed.prefill_s)
                    sample["decode"].append(statistics.median(timed.decode_rates))
                    sample["prefill_cpu"].append(batch * PROMPT_LEN / timed.prefill_cpu_s)
                    sample["decode_cpu"].append(statistics.median(timed.decode_cpu_rates))
                    tokens[(impl, batch)] = timed.tokens
            logger.info("%s: round %d/%d done (load %.1f)", name, r + 1, rounds, os.getloadavg()[0])
    finally:
        for llm in engines.values():
            llm.shutdown()
    rows = []
    for batch in batches:
        row = dict(batch=batch)
        for impl in engines:
            for phase in PHASES:
                row[f"{impl}_{phase}_tok_s"] = round(statistics.median(samples[(impl, batch)][phase]), 1)
        if len(engines) == 2:
            for phase in PHASES:
                row[f"{phase}_ratio"] = round(row[f"transformers_{phase}_tok_s"] / row[f"native_{phase}_tok_s"], 3)
            row["tokens_equal"] = tokens[("native", batch)] == tokens[("transformers", batch)]
        rows.append(row)
    return dict(model=name, architecture=config["architectures"][0], checkpoint=path.name, rows=rows,
                failures=failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=list(CHECKPOINTS), choices=list(CHECKPOINTS))
    parser.add_argument("--output", default=str(RESULTS / "transformers_backend.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    load_before = os.getloadavg()
    started = time.time()
    models = [measure_model(name, args.rounds, args.batches, args.new_tokens) for name in args.models]
    result = dict(
        description="--model-impl transformers vs native, one rank each in one process, interleaved rounds; "
                    "prefill: prompt tokens / s to the step giving the first tokens; decode: the median decode "
                    "step's new tokens / s; *_cpu: the same per CPU second of this process; medians over rounds; "
                    "ratio = transformers / native",
        prompt_len=PROMPT_LEN, new_tokens=args.new_tokens, rounds=args.rounds, dtype="float32", device="cpu",
        torch_threads=torch.get_num_threads(), machine=platform.machine(), cpus=os.cpu_count(),
        load_average_before=[round(x, 2) for x in load_before],
        load_average_after=[round(x, 2) for x in os.getloadavg()], seconds=round(time.time() - started, 1),
        models=models)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    for model in models:
        for row in model["rows"]:
            print(model["model"], json.dumps(row))
        for impl, why in model["failures"].items():
            print(model["model"], impl, "FAILED:", why)
    print("wrote", args.output)


if __name__ == "__main__":
    main()
