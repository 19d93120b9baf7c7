"""Offline generation: this runtime vs transformers `generate` on the same Qwen3-MoE-shaped checkpoint.

Builds (once, cached under bench/.cache) a random Qwen3-MoE checkpoint (hidden 512, 8 layers,
32 experts top-4, moe_intermediate 256, vocab 8192) in fp32 and bf16, then for batch 1 and 16 runs
64 prompt + 64 new tokens (greedy, eos ignored) through both systems, each in its own process so
peak RSS is per system. Prints tokens/s and the ratio; writes bench/results/offline_generate.json.

    python bench/bench_offline.py [--batches 1 16] [--dtypes float32 bfloat16] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import platform
import resource
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results"
PROMPT_LEN = 64
NEW_TOKENS = 64
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
             intermediate_size=1024, vocab_size=8192, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=1024, norm_topk_prob=True, tie_word_embeddings=False)

logger = logging.getLogger("bench_offline")


def build_checkpoint(dtype_name: str) -> Path:
    path = CACHE / f"qwen3moe-bench-{dtype_name}"
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from moe_runtime.random_weights import RandomWeightScales, randomize_weights
    from moe_runtime.tokenizer_training import TokenizerSpec, save_tokenizer, train_tokenizer

    logger.info("building %s checkpoint in %s", dtype_name, path)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**SHAPE, initializer_range=0.05)
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed=0, scales=RandomWeightScales(matrix_std=0.05))
    model = model.to(getattr(torch, dtype_name))
    model.save_pretrained(str(path), safe_serialization=True)
    # The stdlib corpus yields ~6.6k merges at most: a 4096-token tokenizer; ids above it decode to "".
    save_tokenizer(train_tokenizer(TokenizerSpec(vocab_size=4096)), path)
    return path


def copy_bandwidth_gbs() -> float:
    """This machine's memory bandwidth as a same-process copy of 256 MiB sees it (best of 5)."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_per_decode_step(batch: int, dtype_bytes: int) -> float:
    """Weights a decode step must read: everything but the experts, plus the experts the batch's
    tokens touch (expected distinct experts for `batch` tokens with uniform top-k routing)."""
    h, layers, e, k, i = (SHAPE[n] for n in ("hidden_size", "num_hidden_layers", "num_experts",
                                             "num_experts_per_tok", "moe_intermediate_size"))
    heads, kv, d, v = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"], SHAPE["vocab_size"]
    attention = h * d * (2 * heads + 2 * kv)
    touched = e * (1 - (1 - k / e) ** batch)
    experts = touched * 3 * h * i
    return (layers * (attention + experts + h * e) + v * h) * dtype_bytes


def make_prompts(batch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(100, SHAPE["vocab_size"], (batch, PROMPT_LEN), generator=generator).tolist()


def run_runtime(path: str, dtype: str, prompts, repeats: int, queue) -> None:
    torch.set_num_threads(torch.get_num_threads())
    from moe_runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, device="cpu", dtype=dtype, max_num_seqs=max(len(prompts), 1)) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        times, outputs = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append(time.perf_counter() - started)
    queue.put(dict(seconds=min(times), tokens=[o.token_ids for o in outputs],
                   peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def run_transformers(path: str, dtype: str, prompts, repeats: int, queue) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True).eval()
    input_ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(input_ids))
    with torch.no_grad():
        model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        times, out = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            out = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kwargs)
            times.append(time.perf_counter() - started)
    queue.put(dict(seconds=min(times), tokens=out[:, PROMPT_LEN:].tolist(),
                   peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def in_subprocess(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows = []
    bandwidth = copy_bandwidth_gbs()
    for dtype in args.dtypes:
        path = str(build_checkpoint(dtype))
        for batch in args.batches:
            prompts = make_prompts(batch)
            logger.info("dtype=%s batch=%d: runtime", dtype, batch)
            ours = in_subprocess(run_runtime, path, dtype, prompts, args.repeats)
            logger.info("dtype=%s batch=%d: transformers", dtype, batch)
            theirs = in_subprocess(run_transformers, path, dtype, prompts, args.repeats)
            generated = batch * NEW_TOKENS
            same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
            step_bytes = weight_bytes_per_decode_step(batch, torch.tensor([], dtype=getattr(torch, dtype)).element_size())
            steps_per_s = lambda seconds: NEW_TOKENS / seconds  # noqa: E731  (prefill counted as a step)
            rows.append(dict(
                dtype=dtype, batch=batch, runtime_tok_s=generated / ours["seconds"],
                transformers_tok_s=generated / theirs["seconds"], speedup=theirs["seconds"] / ours["seconds"],
                runtime_peak_rss_mib=ours["peak_rss_mib"], transformers_peak_rss_mib=theirs["peak_rss_mib"],
                identical_sequences=f"{same}/{batch}",
                runtime_weight_gbs=step_bytes * steps_per_s(ours["seconds"]) / 1e9,
                transformers_weight_gbs=step_bytes * steps_per_s(theirs["seconds"]) / 1e9,
                copy_bandwidth_gbs=bandwidth,
            ))
    print(f"\nOffline generation, Qwen3-MoE shape, {PROMPT_LEN} prompt + {NEW_TOKENS} new tokens, "
          f"{torch.get_num_threads()} threads")
    header = f"{'dtype':9} {'batch':>5} {'runtime tok/s':>14} {'HF tok/s':>10} {'ratio':>7} {'RSS ours MiB':>13} " \
             f"{'RSS HF MiB':>11} {'same tokens':>12} {'weights GB/s ours/HF':>21} {'memcpy GB/s':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['dtype']:9} {r['batch']:>5} {r['runtime_tok_s']:>14.1f} {r['transformers_tok_s']:>10.1f} "
              f"{r['speedup']:>6.2f}x {r['runtime_peak_rss_mib']:>13.0f} {r['transformers_peak_rss_mib']:>11.0f} "
              f"{r['identical_sequences']:>12} {r['runtime_weight_gbs']:>10.1f}/{r['transformers_weight_gbs']:<10.1f} "
              f"{r['copy_bandwidth_gbs']:>12.1f}")
    print("weights GB/s: expert and dense weights a decode step reads (experts the batch touches), times steps/s;"
          "\nnear the memcpy figure a system is bound by memory bandwidth, not by its overheads.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "offline_generate.json"
    out.write_text(json.dumps(dict(
        benchmark="offline_generate", shape=SHAPE, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
        threads=torch.get_num_threads(), machine=platform.machine(), python=sys.version.split()[0],
        torch=torch.__version__, rows=rows, command="python bench/bench_offline.py",
    ), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
