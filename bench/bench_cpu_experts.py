"""The compiled CPU expert kernel (`--kernels cpu`) against the torch one, side by side in one run.

Two measurements on the MoE bench checkpoint's shape (bench_offline.py: 32 experts top-4, hidden 512,
expert intermediate 256), float32, bfloat16, int8 (per-row scales) and FP8 e4m3fn weights (scales per row and
128-column block, --quantization fp8's layout), decode batches 1 and 16, one thread:
  - the routed experts of one MoE layer (uniform top-4 routing), cycling through the model's 8 layers' weights
    as a step does (one layer's alone would stay in the caches): microseconds per layer for the torch kernel
    and the compiled one, and the weight bytes each streams over this machine's measured copy bandwidth (the
    bound: a decode step's experts are read once);
  - decode tok/s of the whole engine on the bench checkpoint (float32) with each family
    (`planner.cpu_engine_collectives.measure_engine_decode`: the median of 3 decode spans).
Writes bench/results/cpu_experts.json.

    python bench/bench_cpu_experts.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_offline import SHAPE, build_checkpoint, copy_bandwidth_gbs   # noqa: E402
from moe_runtime.kernels.cpu_native.build import native_experts   # noqa: E402
from moe_runtime.kernels.expert_mlp import expert_mlp   # noqa: E402
from moe_runtime.kernels.fp8_block_weights import fp8_expert_mlp   # noqa: E402
from moe_runtime.kernels.int8_weights import int8_expert_mlp   # noqa: E402
from moe_runtime.planner.calibration.cpu_engine_collectives import measure_engine_decode   # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCHES = (1, 16)
FP8_BLOCK_K = 128
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1, "fp8": 1}


def routed_rows(batch: int, num_experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int):
    """A decode batch's rows grouped by expert under uniform top-k routing: (x_sorted, counts)."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(batch)])
    flat = choices.flatten()
    x = torch.randn(batch, hidden, generator=generator).to(dtype)
    return x[flat.argsort(stable=True) // top_k].contiguous(), torch.bincount(flat, minlength=num_experts)


def time_call(fn, repeats: int = 5) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        samples.append((time.perf_counter() - started) / repeats)
    return statistics.median(samples)


def int8_rows_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 codes and float32 scales (the layout of --quantization int8)."""
    scale = w.abs().amax(dim=-1).clamp(min=1e-8) / 127
    return torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8), scale.float()


def fp8_blocks_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3fn codes and float32 scales per row and FP8_BLOCK_K columns, row-expanded (the columns divide)."""
    blocks = w.unflatten(-1, (w.shape[-1] // FP8_BLOCK_K, FP8_BLOCK_K))                  # [..., N, Kb, bk]
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-8) / 448                             # [..., N, Kb]
    return (blocks / scale[..., None]).flatten(-2).to(torch.float8_e4m3fn), scale.float()


def layer_kernels(native, weights: str, x: torch.Tensor, counts: torch.Tensor, layer):
    """(torch call, compiled call) of one layer's experts in the `weights` format."""
    if weights == "fp8":
        (q13, s13), (q2, s2) = layer
        return (lambda: fp8_expert_mlp(x, counts, q13, s13, q2, s2, FP8_BLOCK_K),
                lambda: native.silu_expert_mlp(x, counts, q13, q2, s13, s2, FP8_BLOCK_K))
    if weights == "int8":
        (q13, s13), (q2, s2) = layer
        return (lambda: int8_expert_mlp(x, counts, q13, s13, q2, s2),
                lambda: native.silu_expert_mlp(x, counts, q13, q2, s13, s2))
    w13, w2 = layer
    return lambda: expert_mlp(x, counts, w13, w2), lambda: native.silu_expert_mlp(x, counts, w13, w2)


def layer_rows(native, bandwidth_gbs: float) -> list[dict]:
    e, h, i, k = SHAPE["num_experts"], SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts_per_tok"]
    rows = []
    for weights in ("float32", "bfloat16", "int8", "fp8"):
        # every layer's weights, as a decode step reads them: one layer's alone would stay in the caches
        dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
        layers = [((torch.randn(e, 2 * i, h) * 0.05).to(dtype), (torch.randn(e, h, i) * 0.05).to(dtype))
                  for _ in range(SHAPE["num_hidden_layers"])]
        quantize = {"int8": int8_rows_of, "fp8": fp8_blocks_of}.get(weights)
        if quantize is not None:
            layers = [(quantize(w13), quantize(w2)) for w13, w2 in layers]
        element = ELEMENT_BYTES[weights]
        for batch in BATCHES:
            x, counts = routed_rows(batch, e, k, h, dtype, seed=batch)
            streamed = int((counts > 0).sum()) * 3 * i * h * element
            calls = [layer_kernels(native, weights, x, counts, layer) for layer in layers]
            torch_s = time_call(lambda: [torch_call() for torch_call, _ in calls]) / len(layers)
            native_s = time_call(lambda: [native_call() for _, native_call in calls]) / len(layers)
            rows.append(dict(dtype=weights, batch=batch, weight_bytes=streamed,
                             torch_us=torch_s * 1e6, native_us=native_s * 1e6, native_over_torch=torch_s / native_s,
                             torch_gbs=streamed / torch_s / 1e9, native_gbs=streamed / native_s / 1e9,
                             native_share_of_copy_bandwidth=streamed / native_s / 1e9 / bandwidth_gbs))
            print(f"experts {weights:8s} batch {batch:2d}: torch {torch_s * 1e6:8.0f} us "
                  f"({rows[-1]['torch_gbs']:5.1f} GB/s)  native {native_s * 1e6:8.0f} us ({rows[-1]['native_gbs']:5.1f}"
                  f" GB/s, {rows[-1]['native_share_of_copy_bandwidth']:.0%} of copy)  {rows[-1]['native_over_torch']:.2f}x",
                  flush=True)
    return rows


def engine_rows() -> list[dict]:
    path = build_checkpoint("float32")
    rows = []
    for batch in BATCHES:
        tok_s = {}
        for family in ("torch", "cpu"):
            decode = measure_engine_decode(path, {"kernels": family}, batch, prompt_len=32, decode_tokens=16)
            tok_s[family] = batch / decode.wall_s
        rows.append(dict(batch=batch, torch_tok_s=tok_s["torch"], cpu_tok_s=tok_s["cpu"],
                         cpu_over_torch=tok_s["cpu"] / tok_s["torch"]))
        print(f"engine decode batch {batch:2d}: torch {tok_s['torch']:7.1f} tok/s  cpu {tok_s['cpu']:7.1f} tok/s  "
              f"{rows[-1]['cpu_over_torch']:.2f}x", flush=True)
    return rows


def main() -> int:
    native = native_experts()
    if native is None:
        print("the CPU expert kernel could not be built here (no C++ compiler?)")
        return 1
    torch.set_num_threads(1)
    bandwidth = copy_bandwidth_gbs()
    print(f"copy bandwidth (one thread): {bandwidth:.1f} GB/s", flush=True)
    result = dict(copy_bandwidth_gbs=bandwidth, shape=SHAPE, layer=layer_rows(native, bandwidth), engine=engine_rows())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_experts.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
