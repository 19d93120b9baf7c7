"""The cpu kernel family against the torch family on the MoE bench checkpoint, eager and captured, side by side.

Whether `--kernels cpu` (the compiled expert kernel and few-row GEMV of moe_runtime/kernels/cpu_native/) should be the CPU
default: one process per (dtype, batch) holds four engines (torch / cpu family x eager / captured decode step)
on the same checkpoint (bench/bench_offline.py's: Qwen3-MoE shape, hidden 512, 8 layers, 32 experts top-4) and
generates the same 64 + 64-token greedy requests with each in turn, A B C D D C B A per round, so load from
other processes hits all four alike; the best round of each is kept. Reports tokens/s (generated tokens over the
whole generate call, prefill included, as bench_offline.py does), the cpu/torch ratios, whether the greedy
tokens are identical between the families, the load average and `contended` (load above 1.5).

    python bench/bench_cpu_family.py [--batches 1 16] [--dtypes float32 bfloat16] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_offline import NEW_TOKENS, build_checkpoint, in_subprocess, make_prompts

RESULTS = Path(__file__).resolve().parent / "results"
MODES = [("torch", False), ("cpu", False), ("torch", True), ("cpu", True)]   # (family, captured decode step)
CONTENDED_LOAD = 1.5


def mode_name(family: str, captured: bool) -> str:
    return f"{family}_{'captured' if captured else 'eager'}"


def run_modes(path: str, dtype: str, prompts, rounds: int, threads: int | None, queue) -> None:
    if threads:
        torch.set_num_threads(threads)
    from moe_runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engines = {}
    for family, captured in MODES:
        engines[mode_name(family, captured)] = llm = LLM(
            path, device="cpu", dtype=dtype, max_num_seqs=len(prompts), kernels=family, enable_torch_compile=captured)
        llm.generate(prompts, warm)   # builds the compiled kernels, compiles the captured step's bucket
    seconds = {name: [] for name in engines}
    tokens = {}
    order = list(engines)
    for _ in range(rounds):
        for name in order + order[::-1]:
            started = time.perf_counter()
            outputs = engines[name].generate(prompts, params)
            seconds[name].append(time.perf_counter() - started)
            tokens[name] = [o.token_ids for o in outputs]
    for llm in engines.values():
        llm.shutdown()
    queue.put(dict(seconds=seconds, tokens=tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1: no parallel regions, whose barriers a loaded machine stalls)")
    parser.add_argument("--out", default="cpu_family.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows = []
    for dtype in args.dtypes:
        path = str(build_checkpoint(dtype))
        for batch in args.batches:
            load_before = os.getloadavg()[0]
            result = in_subprocess(run_modes, path, dtype, make_prompts(batch), args.rounds, args.threads)
            load_after = os.getloadavg()[0]
            tok_s = {name: batch * NEW_TOKENS / min(times) for name, times in result["seconds"].items()}
            tokens = result["tokens"]
            same = {mode: sum(a == b for a, b in zip(tokens[f"cpu_{mode}"], tokens[f"torch_{mode}"]))
                    for mode in ("eager", "captured")}
            row = dict(dtype=dtype, batch=batch, tok_s={k: round(v, 1) for k, v in tok_s.items()},
                       cpu_vs_torch_eager=round(tok_s["cpu_eager"] / tok_s["torch_eager"], 2),
                       cpu_vs_torch_captured=round(tok_s["cpu_captured"] / tok_s["torch_captured"], 2),
                       identical_sequences={mode: f"{count}/{batch}" for mode, count in same.items()},
                       load_average=[round(load_before, 2), round(load_after, 2)],
                       contended=max(load_before, load_after) > CONTENDED_LOAD)
            print(json.dumps(row), flush=True)
            rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(dict(
        benchmark="cpu_family", torch=torch.__version__, threads=args.threads or torch.get_num_threads(),
        new_tokens=NEW_TOKENS,
        command="python bench/bench_cpu_family.py " + " ".join(sys.argv[1:]), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
