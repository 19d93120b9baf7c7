"""The transformers backend (`--model-impl transformers`: transformers' modeling code with our paged attention
and MoE executor) against the native ports, on the Qwen3-MoE and DeepSeek-V3 shaped bench checkpoints.

Both engines of a model live in this one process (one rank each, CPU, float32, prefix caching off so every
prefill is computed) and are timed in interleaved rounds (the order alternates per round), so the shared
machine's load falls on both alike. Each round generates 1 + `--new-tokens` tokens per prompt for each batch
size, driving the front step by step: the prefill rate is the prompt tokens over the time to the step that
gives every first token (one step: the batch's prompts fit one step), the decode rate the median over the
decode steps of the tokens a step gives over its time (a median, so a burst of load from other jobs moves it
little). Medians over the rounds, and generic / native ratios.
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


def timed_generate(llm, batch_prompts, max_tokens: int) -> tuple[float, list[float], list[list[int]]]:
    """(seconds to the step giving the first tokens, each later step's tokens / s, the generated tokens)."""
    from moe_runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    front = llm.engine
    ids = [f"bench-{next(REQUEST_IDS)}" for _ in batch_prompts]
    started = time.perf_counter()
    for request_id, prompt in zip(ids, batch_prompts):
        front.add_request(request_id, prompt, params)
    events, finished = [], {}
    while len(finished) < len(ids):
        outputs = front.step()
        tokens = sum(len(o.new_token_ids) for o in outputs)
        if tokens:
            events.append((time.perf_counter(), tokens))
        finished.update((o.request_id, o.token_ids) for o in outputs if o.finished)
    rates = [n / (t - t_before) for (t_before, _), (t, n) in zip(events, events[1:])]
    return events[0][0] - started, rates, [finished[r] for r in ids]


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
    samples = {(impl, b): {"prefill": [], "decode": []} for impl in engines for b in batches}
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
                    prefill_s, rates, out = timed_generate(llm, batch_prompts, 1 + new_tokens)
                    samples[(impl, batch)]["prefill"].append(batch * PROMPT_LEN / prefill_s)
                    samples[(impl, batch)]["decode"].append(statistics.median(rates))
                    tokens[(impl, batch)] = out
            logger.info("%s: round %d/%d done (load %.1f)", name, r + 1, rounds, os.getloadavg()[0])
    finally:
        for llm in engines.values():
            llm.shutdown()
    rows = []
    for batch in batches:
        row = dict(batch=batch)
        for impl in engines:
            for phase in ("prefill", "decode"):
                row[f"{impl}_{phase}_tok_s"] = round(statistics.median(samples[(impl, batch)][phase]), 1)
        if len(engines) == 2:
            for phase in ("prefill", "decode"):
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
                    "step's new tokens / s; medians over rounds; ratio = transformers / native",
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
