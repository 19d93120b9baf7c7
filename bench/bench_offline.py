"""Offline generation: this runtime vs transformers `generate` on the same Qwen3-MoE-shaped checkpoint.

Builds (once, cached under bench/.cache) a random Qwen3-MoE checkpoint (hidden 512, 8 layers,
32 experts top-4, moe_intermediate 256, vocab 8192) in fp32 and bf16, then for batch 1 and 16 runs
64 prompt + 64 new tokens (greedy, eos ignored) through both systems, each in its own process so
peak RSS is per system. Prints tokens/s and the ratio; writes bench/results/offline_generate.json.

`--dtypes fp8` adds FP8 rows: the bf16 checkpoint written in DeepSeek-V3's FP8 block layout (128x128
scales), run three ways in `--fp8-compute-dtype`: this runtime keeping the weights in FP8
(`--quantization fp8`), this runtime dequantizing them at load, and transformers on the dequantized
checkpoint.

    python bench/bench_offline.py [--batches 1 16] [--dtypes float32 bfloat16 fp8] [--repeats 2]
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


def weight_bytes_per_decode_step(batch: int, dtype_bytes: int, projection_bytes: float | None = None) -> float:
    """Weights a decode step must read: everything but the experts, plus the experts the batch's
    tokens touch (expected distinct experts for `batch` tokens with uniform top-k routing).

    `projection_bytes`: bytes per weight of the attention projections and experts when they are
    stored apart from the rest (FP8: 1 byte plus a 4-byte scale per 128 weights of a row).
    """
    h, layers, e, k, i = (SHAPE[n] for n in ("hidden_size", "num_hidden_layers", "num_experts",
                                             "num_experts_per_tok", "moe_intermediate_size"))
    heads, kv, d, v = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"], SHAPE["vocab_size"]
    attention = h * d * (2 * heads + 2 * kv)
    touched = e * (1 - (1 - k / e) ** batch)
    experts = touched * 3 * h * i
    per_projection = dtype_bytes if projection_bytes is None else projection_bytes
    return layers * (attention + experts) * per_projection + (layers * h * e + v * h) * dtype_bytes


FP8_BYTES_PER_WEIGHT = 1 + 4 / 128   # float8_e4m3fn values and their row-expanded 128-column scales


def build_fp8_checkpoints() -> tuple[Path, Path]:
    """(FP8 checkpoint, its dequantized float32 twin for transformers) from the bf16 checkpoint, built once."""
    fp8, oracle = CACHE / "qwen3moe-bench-fp8", CACHE / "qwen3moe-bench-fp8-dequantized"
    if (fp8 / "config.json").exists() and (oracle / "config.json").exists():
        return fp8, oracle
    from moe_runtime.quantization.fp8_checkpoint_writer import copy_side_files, write_fp8_checkpoint, write_two_shards

    source = build_checkpoint("bfloat16")
    logger.info("writing the FP8 checkpoint %s and its dequantized twin %s", fp8, oracle)
    tensors = write_fp8_checkpoint(source, fp8)
    copy_side_files(source, oracle)
    write_two_shards(tensors.dequantized, oracle)
    return fp8, oracle


def make_prompts(batch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(100, SHAPE["vocab_size"], (batch, PROMPT_LEN), generator=generator).tolist()


def run_runtime(path: str, dtype: str, prompts, repeats: int, queue, quantization: str | None = None) -> None:
    torch.set_num_threads(torch.get_num_threads())
    from moe_runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, device="cpu", dtype=dtype, max_num_seqs=max(len(prompts), 1), quantization=quantization) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        times, outputs = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append(time.perf_counter() - started)
        model = llm.engine.core.model            # one rank: the engine is in this process
        weight_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    queue.put(dict(seconds=min(times), tokens=[o.token_ids for o in outputs], weight_mib=weight_mib,
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


def in_subprocess(target, *args, **kwargs) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue), kwargs=kwargs)
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fp8-compute-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="activations and dequantized tiles of the fp8 rows")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows = []
    bandwidth = copy_bandwidth_gbs()
    fp8_rows = (measure_fp8(args.batches, args.repeats, args.fp8_compute_dtype, bandwidth)
                if "fp8" in args.dtypes else [])
    for dtype in (d for d in args.dtypes if d != "fp8"):
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
    print_fp8_rows(fp8_rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    common = dict(shape=SHAPE, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, threads=torch.get_num_threads(),
                  machine=platform.machine(), python=sys.version.split()[0], torch=torch.__version__,
                  command="python bench/bench_offline.py " + " ".join(sys.argv[1:]))
    written = []
    if rows:   # each table has its own file: an fp8-only run does not erase the dtype rows
        written.append(RESULTS / "offline_generate.json")
        written[-1].write_text(json.dumps(dict(benchmark="offline_generate", **common, rows=rows), indent=2))
    if fp8_rows:
        written.append(RESULTS / "offline_fp8.json")
        written[-1].write_text(json.dumps(dict(benchmark="offline_fp8", **common, rows=fp8_rows), indent=2))
    out = ", ".join(str(path) for path in written)
    print(f"\nwrote {out}")


def measure_fp8(batches: list[int], repeats: int, compute_dtype: str, bandwidth: float) -> list[dict]:
    """Kept in FP8 vs dequantized at load vs transformers on the dequantized checkpoint, per batch."""
    fp8, oracle = (str(p) for p in build_fp8_checkpoints())
    dtype_bytes = torch.tensor([], dtype=getattr(torch, compute_dtype)).element_size()
    rows = []
    for batch in batches:
        prompts = make_prompts(batch)
        logger.info("fp8 batch=%d: runtime kept in FP8, runtime dequantized, transformers", batch)
        kept = in_subprocess(run_runtime, fp8, compute_dtype, prompts, repeats, quantization="fp8")
        dequantized = in_subprocess(run_runtime, fp8, compute_dtype, prompts, repeats)
        theirs = in_subprocess(run_transformers, oracle, compute_dtype, prompts, repeats)
        generated = batch * NEW_TOKENS
        kept_bytes = weight_bytes_per_decode_step(batch, dtype_bytes, FP8_BYTES_PER_WEIGHT)
        dense_bytes = weight_bytes_per_decode_step(batch, dtype_bytes)
        rows.append(dict(
            compute_dtype=compute_dtype, batch=batch, kept_fp8_tok_s=generated / kept["seconds"],
            dequantized_tok_s=generated / dequantized["seconds"], transformers_tok_s=generated / theirs["seconds"],
            kept_vs_dequantized=dequantized["seconds"] / kept["seconds"],
            kept_vs_transformers=theirs["seconds"] / kept["seconds"],
            kept_weight_bytes_per_step=kept_bytes, dequantized_weight_bytes_per_step=dense_bytes,
            kept_weight_gbs=kept_bytes * NEW_TOKENS / kept["seconds"] / 1e9,
            dequantized_weight_gbs=dense_bytes * NEW_TOKENS / dequantized["seconds"] / 1e9,
            kept_weight_mib=kept["weight_mib"], dequantized_weight_mib=dequantized["weight_mib"],
            kept_peak_rss_mib=kept["peak_rss_mib"], dequantized_peak_rss_mib=dequantized["peak_rss_mib"],
            identical_to_dequantized=f"{sum(a == b for a, b in zip(kept['tokens'], dequantized['tokens']))}/{batch}",
            identical_to_transformers=f"{sum(a == b for a, b in zip(kept['tokens'], theirs['tokens']))}/{batch}",
            copy_bandwidth_gbs=bandwidth,
        ))
    return rows


def print_fp8_rows(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\nFP8 checkpoint (128x128 blocks), compute {rows[0]['compute_dtype']}: decode tok/s")
    header = f"{'batch':>5} {'kept FP8':>9} {'dequantized':>12} {'HF deq.':>8} {'vs deq.':>8} {'vs HF':>7} " \
             f"{'MB/step FP8/deq.':>17} {'weights MiB FP8/deq.':>21} {'same tokens deq./HF':>20}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['batch']:>5} {r['kept_fp8_tok_s']:>9.1f} {r['dequantized_tok_s']:>12.1f} "
              f"{r['transformers_tok_s']:>8.1f} {r['kept_vs_dequantized']:>7.2f}x {r['kept_vs_transformers']:>6.2f}x "
              f"{r['kept_weight_bytes_per_step'] / 1e6:>8.1f}/{r['dequantized_weight_bytes_per_step'] / 1e6:<8.1f} "
              f"{r['kept_weight_mib']:>10.0f}/{r['dequantized_weight_mib']:<10.0f} "
              f"{r['identical_to_dequantized']:>9}/{r['identical_to_transformers']:<10}")


if __name__ == "__main__":
    main()
