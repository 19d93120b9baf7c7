"""Offline generation: this runtime vs transformers `generate` on the same Qwen3-MoE-shaped checkpoint.

Builds (once, cached under bench/.cache) a random Qwen3-MoE checkpoint (hidden 512, 8 layers,
32 experts top-4, moe_intermediate 256, vocab 8192) in fp32 and bf16, then for batch 1 and 16 runs
64 prompt + 64 new tokens (greedy, eos ignored) through both systems, each in its own process so
peak RSS is per system. Prints tokens/s and the ratio; writes bench/results/offline_generate.json.

`--dtypes fp8` adds FP8 rows: the bf16 checkpoint written in DeepSeek-V3's FP8 block layout (128x128
scales), run three ways in `--fp8-compute-dtype`: this runtime keeping the weights in FP8
(`--quantization fp8`), this runtime dequantizing them at load, and transformers on the dequantized
checkpoint.

`--dtypes int8` adds int8 rows: the float32 checkpoint run by this runtime with `--quantization int8`
(projections and experts int8 with one fp32 scale per output row, quantized at load; fp32
activations), by the same runtime in fp32, and by transformers in fp32; written to
bench/results/offline_int8.json.

`--llama-cpp DIR` adds llama.cpp, measured in the same run on the same weights converted to GGUF
(F32 for float32, BF16 for bfloat16): `llama_cpp_tok_s` (llama-batched-bench, batch sequences of
64 + 64, generated tokens over prefill + decode time like the other columns, best of `--repeats`
runs), its prefill and decode rates apart, llama-bench's batch-1 rates as a cross-check, and
`vs_llama_cpp` (this runtime's tok/s over llama.cpp's). DIR holds `llama-bench` and
`llama-batched-bench` (or is a build directory with them in bin/). The GGUF files are read from
`--gguf-dir` (default bench/.cache/gguf, named <checkpoint>-<F32|BF16|Q8_0>.gguf); missing or stale
ones are converted there when `--llama-cpp-src` names llama.cpp's source tree (its
convert_hf_to_gguf.py, run through bench/gguf_convert.py, which accepts this repo's tokenizer).
`--dtypes q8_0` adds llama.cpp-only reference rows on the float32 checkpoint quantized to Q8_0.
How to build llama.cpp and convert by hand: docs/llama_cpp.md. Without `--llama-cpp` nothing
changes.

`--breakdown` profiles this runtime's decode step per row (bench/step_breakdown.py, its own
process): `kernel_share` is the self CPU time of operators over the step's wall time under the
profiler, `other_share` the rest (Python, scheduling, sampling, metadata); `decode_step_ms` is the
unprofiled step. `--breakdown-steps` sets how many steps are profiled.

    python bench/bench_offline.py [--batches 1 16] [--dtypes float32 bfloat16 fp8 int8 q8_0] [--repeats 2]
        [--llama-cpp /work/llama_cpp/build/bin [--gguf-dir DIR] [--llama-cpp-src /work/llama_cpp/src]]
        [--breakdown [--breakdown-steps 5]]
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.dense_bench_model import DENSE_SHAPE, build_dense_checkpoint, dense_weight_bytes_per_decode_step
from bench.gguf_convert import GgufTarget, ensure_gguf
from bench.llama_cpp import LlamaCppRates, LlamaCppTools
from bench.offline_tables import (print_compiled_rows, print_cpu_experts_rows, print_fp8_rows, print_int8_rows,
                                  print_llama_cpp_reference_rows, print_rows)
from bench.offline_rounds import median_rows
from bench.step_breakdown import run_step_breakdown
from moe_runtime.planner.calibration.calibration_models import QWEN3_MOE_SHAPE

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results"
PROMPT_LEN = 64
NEW_TOKENS = 64
SHAPE = QWEN3_MOE_SHAPE   # the planner's CPU calibration times this shape too

GGUF_FILE_TYPE = {"float32": "F32", "bfloat16": "BF16"}   # the GGUF a dtype row's checkpoint is converted to
LLAMA_CPP_ONLY_DTYPE = "q8_0"    # --dtypes q8_0: llama.cpp-only reference rows

logger = logging.getLogger("bench_offline")


def build_checkpoint(dtype_name: str) -> Path:
    path = CACHE / f"qwen3moe-bench-{dtype_name}"
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights
    from moe_runtime.demo.tokenizer_training import TokenizerSpec, save_tokenizer, train_tokenizer

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
INT8_BYTES_PER_WEIGHT = 1 + 4 / 256   # int8 values and one fp32 scale per row (rows of >= 256 inputs here)


def build_fp8_checkpoints() -> tuple[Path, Path]:
    """(FP8 checkpoint, its dequantized float32 twin for transformers) from the bf16 checkpoint, built once."""
    fp8, oracle = CACHE / "qwen3moe-bench-fp8", CACHE / "qwen3moe-bench-fp8-dequantized"
    if (fp8 / "config.json").exists() and (oracle / "config.json").exists():
        return fp8, oracle
    from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, write_fp8_checkpoint, write_two_shards

    source = build_checkpoint("bfloat16")
    logger.info("writing the FP8 checkpoint %s and its dequantized twin %s", fp8, oracle)
    tensors = write_fp8_checkpoint(source, fp8)
    copy_side_files(source, oracle)
    write_two_shards(tensors.dequantized, oracle)
    return fp8, oracle


def make_prompts(batch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(100, SHAPE["vocab_size"], (batch, PROMPT_LEN), generator=generator).tolist()


def run_runtime(path: str, dtype: str, prompts, repeats: int, queue, quantization: str | None = None,
                compile_decode: bool = False, kernels: str = "auto", cpu_experts: bool = False,
                wrapper: str = "aot") -> None:
    torch.set_num_threads(torch.get_num_threads())
    from moe_runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, device="cpu", dtype=dtype, max_num_seqs=max(len(prompts), 1), quantization=quantization,
             enable_torch_compile=compile_decode, kernels=kernels, cpu_experts=cpu_experts,
             torch_compile_wrapper=wrapper) as llm:
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up (+ compile)
        warmup_seconds = time.perf_counter() - started
        times, outputs = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append(time.perf_counter() - started)
        model = llm.core.model            # one rank: the engine is in this process
        weight_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        capture = llm.core.runner.capture
        captured_steps = capture.stats.captured_steps if capture is not None else 0
    queue.put(dict(seconds=min(times), tokens=[o.token_ids for o in outputs], weight_mib=weight_mib,
                   peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   warmup_seconds=warmup_seconds, captured_steps=captured_steps))


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
    parser.add_argument("--llama-cpp", type=Path, help="directory with llama-bench and llama-batched-bench")
    parser.add_argument("--gguf-dir", type=Path, default=CACHE / "gguf", help="where the GGUF files are (or go)")
    parser.add_argument("--llama-cpp-src", type=Path,
                        help="llama.cpp source tree: convert missing GGUF files with its convert_hf_to_gguf.py")
    parser.add_argument("--breakdown", action="store_true", help="profile this runtime's decode step per row")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also run this runtime with --enable-torch-compile (the captured decode step) per row")
    parser.add_argument("--breakdown-steps", type=int, default=5)
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "cpu"],
                        help="this runtime's kernel family (cpu: the compiled CPU kernels, moe_runtime/kernels/cpu_native)")
    parser.add_argument("--dense", action="store_true",
                        help="also the dense ~90M Llama-shaped model (bench/dense_bench_model.py) per dtype")
    parser.add_argument("--dense-only", action="store_true", help="the dense model's rows alone (implies --dense)")
    parser.add_argument("--out", default="offline_generate.json",
                        help="file name of the dtype rows' JSON in bench/results (a partial run keeps the full one)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every row this many times, round after round; medians (bench/offline_rounds.py)")
    parser.add_argument("--torch-compile-wrapper", default="aot", choices=["aot", "cpp", "python"],
                        help="what runs the captured step's graph on the CPU (EngineConfig.torch_compile_wrapper)")
    parser.add_argument("--cpu-experts", action="store_true",
                        help="also this runtime with --cpu-experts (routed experts on their own thread) per MoE row")
    args = parser.parse_args()
    args.dense = args.dense or args.dense_only
    if LLAMA_CPP_ONLY_DTYPE in args.dtypes and args.llama_cpp is None:
        parser.error(f"--dtypes {LLAMA_CPP_ONLY_DTYPE} rows are llama.cpp's only: pass --llama-cpp")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bandwidth = copy_bandwidth_gbs()
    fp8_rows = (measure_fp8(args.batches, args.repeats, args.fp8_compute_dtype, bandwidth)
                if "fp8" in args.dtypes else [])
    llama = LlamaCppRun(args.llama_cpp, args.gguf_dir, args.llama_cpp_src, args.repeats) if args.llama_cpp else None
    int8_rows = measure_int8(args.batches, args.repeats, bandwidth) if "int8" in args.dtypes else []
    dtypes = [d for d in args.dtypes if d not in ("fp8", "int8", LLAMA_CPP_ONLY_DTYPE)]
    models = [(model, dtype) for model in ("moe", "dense")[args.dense_only:1 + args.dense] for dtype in dtypes]
    rounds = []
    for round_index in range(args.rounds):   # every row's systems once a round (bench/offline_rounds.py)
        rows = []
        bandwidth = bandwidth if round_index == 0 else copy_bandwidth_gbs()
        for model, dtype in models:
            dtype_bytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
            path = str(build_checkpoint(dtype) if model == "moe" else
                       build_dense_checkpoint(dtype, CACHE, build_checkpoint(dtype)))
            llama_rates = llama.rates(Path(path), GGUF_FILE_TYPE[dtype], args.batches) if llama else {}
            for batch in args.batches:
                prompts = make_prompts(batch)
                logger.info("model=%s dtype=%s batch=%d: runtime", model, dtype, batch)
                ours = in_subprocess(run_runtime, path, dtype, prompts, args.repeats, kernels=args.kernels)
                logger.info("dtype=%s batch=%d: transformers", dtype, batch)
                theirs = in_subprocess(run_transformers, path, dtype, prompts, args.repeats)
                generated = batch * NEW_TOKENS
                same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
                step_bytes = (weight_bytes_per_decode_step(batch, dtype_bytes) if model == "moe" else
                              dense_weight_bytes_per_decode_step(dtype_bytes))
                steps_per_s = lambda seconds: NEW_TOKENS / seconds  # noqa: E731  (prefill counted as a step)
                rows.append(dict(
                    model=model, dtype=dtype, batch=batch, kernels=args.kernels, runtime_tok_s=generated / ours["seconds"],
                    transformers_tok_s=generated / theirs["seconds"], speedup=theirs["seconds"] / ours["seconds"],
                    runtime_peak_rss_mib=ours["peak_rss_mib"], transformers_peak_rss_mib=theirs["peak_rss_mib"],
                    identical_sequences=f"{same}/{batch}",
                    runtime_weight_gbs=step_bytes * steps_per_s(ours["seconds"]) / 1e9,
                    transformers_weight_gbs=step_bytes * steps_per_s(theirs["seconds"]) / 1e9,
                    weight_bytes_per_step=step_bytes, copy_bandwidth_gbs=bandwidth,
                    bandwidth_bound_tok_s=batch * bandwidth * 1e9 / step_bytes,
                ))
                if args.cpu_experts and model == "moe":
                    logger.info("dtype=%s batch=%d: runtime, --cpu-experts", dtype, batch)
                    offloaded = in_subprocess(run_runtime, path, dtype, prompts, args.repeats, kernels=args.kernels,
                                              cpu_experts=True)
                    rows[-1].update(cpu_experts_tok_s=generated / offloaded["seconds"],
                                    cpu_experts_vs_eager=ours["seconds"] / offloaded["seconds"],
                                    cpu_experts_identical=f"{sum(a == b for a, b in zip(offloaded['tokens'], ours['tokens']))}"
                                                          f"/{batch}")
                if llama or args.breakdown or args.rounds > 1:   # the machine may be shared: how busy it was for this row
                    rows[-1].update(load_avg_1m=os.getloadavg()[0])
                if batch in llama_rates:
                    rows[-1].update(llama_cpp_columns(llama_rates[batch], rows[-1]["runtime_tok_s"], GGUF_FILE_TYPE[dtype]))
                    rows[-1].update(llama_cpp_bound_fraction=rows[-1]["llama_cpp_tok_s"] /
                                    rows[-1]["bandwidth_bound_tok_s"])
                if args.breakdown:
                    logger.info("dtype=%s batch=%d: decode step breakdown", dtype, batch)
                    breakdown = in_subprocess(run_step_breakdown, path, dtype, prompts, args.breakdown_steps)
                    rows[-1].update(kernel_share=breakdown["kernel_share"], other_share=breakdown["other_share"],
                                    decode_step_ms=breakdown["step_ms"], step_breakdown=breakdown)
                if args.torch_compile:
                    logger.info("dtype=%s batch=%d: runtime, captured decode step", dtype, batch)
                    compiled = in_subprocess(run_runtime, path, dtype, prompts, args.repeats, compile_decode=True,
                                             kernels=args.kernels)
                    rows[-1].update(compiled_columns(compiled, ours, theirs, rows[-1], generated, step_bytes))
                    if args.breakdown:
                        breakdown = in_subprocess(run_step_breakdown, path, dtype, prompts, args.breakdown_steps,
                                                  compile_decode=True)
                        rows[-1].update(compiled_kernel_share=breakdown["kernel_share"],
                                        compiled_other_share=breakdown["other_share"],
                                        compiled_decode_step_ms=breakdown["step_ms"], compiled_step_breakdown=breakdown)
        rounds.append(rows)
        if args.rounds > 1:   # what the rounds so far gave, should a long run be cut short
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{Path(args.out).stem}.rounds_so_far.json").write_text(json.dumps(
                dict(benchmark="offline_generate", command=" ".join(sys.argv[1:]), rows=median_rows(rounds)),
                indent=2))
    rows = median_rows(rounds)
    reference_rows = (llama.reference_rows(args.batches) if llama and LLAMA_CPP_ONLY_DTYPE in args.dtypes else [])
    print_rows(rows, PROMPT_LEN, NEW_TOKENS, torch.get_num_threads())
    print_compiled_rows(rows)
    print_cpu_experts_rows(rows)
    print_fp8_rows(fp8_rows)
    print_int8_rows(int8_rows)
    print_llama_cpp_reference_rows(reference_rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    common = dict(shape=SHAPE, dense_shape=DENSE_SHAPE, kernels=args.kernels, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, threads=torch.get_num_threads(),
                  machine=platform.machine(), python=sys.version.split()[0], torch=torch.__version__,
                  command="python bench/bench_offline.py " + " ".join(sys.argv[1:]))
    if llama:
        common.update(llama_cpp_version=llama.tools.version())
    written = []
    extra = dict(llama_cpp_reference_rows=reference_rows) if reference_rows else {}
    if rows or (reference_rows and not int8_rows):   # each table has its own file: an fp8-only or int8-only run
        written.append(RESULTS / args.out)   # does not erase the dtype rows
        written[-1].write_text(json.dumps(dict(benchmark="offline_generate", **common, rows=rows, **extra), indent=2))
    if fp8_rows:
        written.append(RESULTS / "offline_fp8.json")
        written[-1].write_text(json.dumps(dict(benchmark="offline_fp8", **common, rows=fp8_rows), indent=2))
    if int8_rows:
        written.append(RESULTS / "offline_int8.json")
        written[-1].write_text(json.dumps(dict(benchmark="offline_int8", **common, rows=int8_rows, **extra), indent=2))
    (RESULTS / f"{Path(args.out).stem}.rounds_so_far.json").unlink(missing_ok=True)   # the whole run is written
    out = ", ".join(str(path) for path in written)
    print(f"\nwrote {out}")


def compiled_columns(compiled: dict, eager: dict, theirs: dict, row: dict, generated: int, step_bytes: float) -> dict:
    """The captured-decode run of a row beside its eager run, transformers and (when measured) llama.cpp."""
    tok_s = generated / compiled["seconds"]
    same = sum(a == b for a, b in zip(compiled["tokens"], eager["tokens"]))
    columns = dict(compiled_tok_s=tok_s, compiled_vs_eager=eager["seconds"] / compiled["seconds"],
                   compiled_vs_transformers=theirs["seconds"] / compiled["seconds"],
                   compiled_identical_to_eager=f"{same}/{len(eager['tokens'])}",
                   compiled_warmup_seconds=compiled["warmup_seconds"], compiled_steps=compiled["captured_steps"],
                   compiled_weight_gbs=step_bytes * (NEW_TOKENS / compiled["seconds"]) / 1e9,
                   compiled_bound_fraction=tok_s / row["bandwidth_bound_tok_s"])
    if "llama_cpp_tok_s" in row:
        columns.update(compiled_vs_llama_cpp=tok_s / row["llama_cpp_tok_s"])
    return columns


def llama_cpp_columns(rates: LlamaCppRates, runtime_tok_s: float, file_type: str) -> dict:
    columns = dict(llama_cpp_gguf=file_type, llama_cpp_tok_s=rates.generated_tok_s,
                   vs_llama_cpp=runtime_tok_s / rates.generated_tok_s,
                   llama_cpp_prefill_tok_s=rates.prefill_tok_s, llama_cpp_decode_tok_s=rates.decode_tok_s)
    if rates.llama_bench_decode_tok_s is not None:
        columns.update(llama_bench_prefill_tok_s=rates.llama_bench_prefill_tok_s,
                       llama_bench_decode_tok_s=rates.llama_bench_decode_tok_s)
    return columns


@dataclass(frozen=True)
class LlamaCppRun:
    """llama.cpp's side of a bench run: its tools, where the GGUF files are, how to make missing ones."""
    bin_dir: Path
    gguf_dir: Path
    converter_dir: Path | None
    repeats: int

    @property
    def tools(self) -> LlamaCppTools:
        return LlamaCppTools(self.bin_dir, threads=torch.get_num_threads())

    def rates(self, checkpoint: Path, file_type: str, batches: list[int]) -> dict[int, LlamaCppRates]:
        gguf = ensure_gguf(GgufTarget(checkpoint, file_type, self.gguf_dir), self.converter_dir)
        logger.info("llama.cpp on %s, batches %s", gguf.name, batches)
        return self.tools.measure(gguf, PROMPT_LEN, NEW_TOKENS, batches, self.repeats)

    def reference_rows(self, batches: list[int]) -> list[dict]:
        """llama.cpp alone on the float32 checkpoint quantized to Q8_0: a reference for the `--dtypes int8` rows."""
        rates = self.rates(build_checkpoint("float32"), "Q8_0", batches)
        return [dict(dtype=LLAMA_CPP_ONLY_DTYPE, batch=batch, llama_cpp_gguf="Q8_0", llama_cpp_tok_s=r.generated_tok_s,
                     llama_cpp_prefill_tok_s=r.prefill_tok_s, llama_cpp_decode_tok_s=r.decode_tok_s,
                     **({} if r.llama_bench_decode_tok_s is None else
                        dict(llama_bench_prefill_tok_s=r.llama_bench_prefill_tok_s,
                             llama_bench_decode_tok_s=r.llama_bench_decode_tok_s)))
                for batch, r in sorted(rates.items())]


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


def measure_int8(batches: list[int], repeats: int, bandwidth: float) -> list[dict]:
    """The float32 checkpoint: this runtime with int8 weights vs the same runtime in fp32 vs transformers fp32."""
    path = str(build_checkpoint("float32"))
    rows = []
    for batch in batches:
        prompts = make_prompts(batch)
        logger.info("int8 batch=%d: runtime int8, runtime fp32, transformers fp32", batch)
        int8 = in_subprocess(run_runtime, path, "float32", prompts, repeats, quantization="int8")
        fp32 = in_subprocess(run_runtime, path, "float32", prompts, repeats)
        theirs = in_subprocess(run_transformers, path, "float32", prompts, repeats)
        generated = batch * NEW_TOKENS
        int8_bytes = weight_bytes_per_decode_step(batch, 4, INT8_BYTES_PER_WEIGHT)
        fp32_bytes = weight_bytes_per_decode_step(batch, 4)
        same = lambda a, b: f"{sum(x == y for x, y in zip(a['tokens'], b['tokens']))}/{batch}"  # noqa: E731
        rows.append(dict(
            batch=batch, int8_tok_s=generated / int8["seconds"], fp32_tok_s=generated / fp32["seconds"],
            transformers_fp32_tok_s=generated / theirs["seconds"],
            int8_vs_fp32=fp32["seconds"] / int8["seconds"], int8_vs_transformers=theirs["seconds"] / int8["seconds"],
            int8_weight_mib=int8["weight_mib"], fp32_weight_mib=fp32["weight_mib"],
            int8_weight_bytes_per_step=int8_bytes, fp32_weight_bytes_per_step=fp32_bytes,
            int8_weight_gbs=int8_bytes * NEW_TOKENS / int8["seconds"] / 1e9,
            fp32_weight_gbs=fp32_bytes * NEW_TOKENS / fp32["seconds"] / 1e9,
            int8_peak_rss_mib=int8["peak_rss_mib"], fp32_peak_rss_mib=fp32["peak_rss_mib"],
            identical_int8_to_fp32=same(int8, fp32), identical_int8_to_transformers=same(int8, theirs),
            identical_fp32_to_transformers=same(fp32, theirs), copy_bandwidth_gbs=bandwidth,
        ))
    return rows




if __name__ == "__main__":
    main()
