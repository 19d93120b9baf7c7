"""What running attention on transformers' own cache and mask costs (transformers_backend/own_cache_attention.py).

The sweep's tiny DeepSeek-V3.2 (sparse-attention indexer on every layer) through `--model-impl transformers` (every
layer's attention run per sequence, eager, on a cache gathered from the paged blocks) against our native port, and
the same pair for DeepSeek-V3 (no indexer: the transformers backend's batched path) to tell the fallback's share
from the backend's own overhead. 8 prompts of 64 tokens, 32 greedy tokens each, one rank, CPU, one thread; best of
3 rounds. Writes bench/results/own_cache_attention.json (times and generic/native ratios; tokens must agree).

    python bench/bench_own_cache_attention.py
"""
from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))   # the sweep's checkpoints live with the tests

PROMPTS = [[(i * 37 + 11 * s) % 500 + 3 for i in range(64)] for s in range(8)]
NEW_TOKENS, ROUNDS = 32, 3


def timed(path: Path, model_impl: str) -> tuple[float, list[list[int]]]:
    from engine_helpers import greedy
    from moe_runtime import LLM

    with LLM(str(path), device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=256, max_num_seqs=8,
             kv_cache_memory=32 * 2**20, model_impl=model_impl) as llm:
        llm.generate(PROMPTS[:1], greedy(4))   # warm-up
        best, outputs = float("inf"), []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
            best = min(best, time.perf_counter() - start)
    return best, [o.token_ids for o in outputs]


def main() -> None:
    from arch_sweep_cases import build_sweep_checkpoint
    from tiny_checkpoints import tiny_tokenizer

    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        tiny_tokenizer().save_pretrained(str(tokenizer_dir))
        for model_type in ("deepseek_v32", "deepseek_v3"):
            path = build_sweep_checkpoint(model_type, Path(tmp) / model_type, tokenizer_dir)
            native, native_tokens = timed(path, "native")
            generic, generic_tokens = timed(path, "transformers")
            rows[model_type] = {"native_s": round(native, 3), "transformers_s": round(generic, 3),
                                "ratio": round(generic / native, 2), "same_tokens": native_tokens == generic_tokens}
            print(model_type, rows[model_type], flush=True)
    out = REPO / "bench" / "results" / "own_cache_attention.json"
    out.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "prompts": len(PROMPTS), "prompt_len": 64,
                               "new_tokens": NEW_TOKENS, "machine": platform.machine(), "threads": 1,
                               "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
