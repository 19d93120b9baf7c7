"""What `--deterministic` costs: prefill and decode tokens/s with the batch-invariant kernels on and off, side by side.

The bench_offline Qwen3-MoE checkpoint (hidden 512, 8 layers, 32 experts top-4, vocab 8192, fp32; built once under
bench/.cache), one rank on CPU, prefix caching off. Per mode: prefill is `--batch` prompts of `--prompt-len` tokens
generating one token (tokens/s over prompt tokens); decode is the same prompts generating `--new-tokens` tokens, the
prefill's time subtracted (tokens/s over generated tokens). Best of `--repeats` runs, the modes alternated so that the
shared machine's load falls on both. Writes bench/results/deterministic.json.

    python bench/bench_deterministic.py [--batch 8] [--prompt-len 64] [--new-tokens 24] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.bench_offline import SHAPE, build_checkpoint
from moe_runtime import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "deterministic.json"
MODES = {"off": False, "on": True}


def prompts_of(batch: int, length: int) -> list[list[int]]:
    return [[(37 * i + 11 * b) % 4000 + 10 for i in range(length)] for b in range(batch)]


def timed_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = str(build_checkpoint("float32"))
    prompts = prompts_of(args.batch, args.prompt_len)
    engines = {mode: LLM(path, device="cpu", dtype="float32", deterministic=on, enable_prefix_caching=False)
               for mode, on in MODES.items()}
    for llm in engines.values():
        timed_generate(llm, prompts[:2], 2)                                      # warm up
    prefill = {mode: float("inf") for mode in MODES}
    whole = {mode: float("inf") for mode in MODES}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            prefill[mode] = min(prefill[mode], timed_generate(llm, prompts, 1))
            whole[mode] = min(whole[mode], timed_generate(llm, prompts, args.new_tokens))
    for llm in engines.values():
        llm.shutdown()
    rows = {}
    for mode in MODES:
        decode_seconds = max(whole[mode] - prefill[mode], 1e-9)
        rows[mode] = {"prefill_tok_s": round(args.batch * args.prompt_len / prefill[mode], 1),
                      "decode_tok_s": round(args.batch * (args.new_tokens - 1) / decode_seconds, 1)}
    result = {
        "model": {key: SHAPE[key] for key in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                                              "moe_intermediate_size", "vocab_size")},
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "modes": rows,
        "on_over_off": {key: round(rows["on"][key] / rows["off"][key], 3) for key in rows["on"]},
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
