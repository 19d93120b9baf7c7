"""MoE layer forward: this runtime's kernels vs the transformers MoE block vs a naive loop.

Two layers, the same weights for every contender (the HF module's own parameter tensors):
  qwen3     Qwen3MoeSparseMoeBlock  hidden 512, 32 experts, top-4, moe_intermediate 256
  deepseek  DeepseekV3MoE           hidden 2048, 64 experts (8 groups, top-4 groups), top-6,
                                    moe_intermediate 1408, 1 shared expert (DeepSeek-V3 routing,
                                    scaled to fit)
Contenders, per token count T:
  runtime     router linear + kernels.select_experts + the MoE seam on one rank (local dispatcher x
              the family's expert kernel; the shared expert through the same kernel as a one-expert
              layer): the path the engine runs
  hf_grouped  the transformers block with experts_implementation="grouped_mm" (what
              from_pretrained picks by default)
  hf_eager    the transformers block with experts_implementation="eager" (loop over hit experts)
  naive       per-token loop over its top-k experts (only up to the layer's naive_max_tokens)
  runtime_torch  (CUDA only) the runtime with the torch kernel family instead of Triton
FLOPs are the useful ones (router + routed + shared matmuls, same for everyone); the peak is this
machine's dense matmul measured here (same dtype, same threads). Timings are the best of the
repeats, contenders interleaved: on a shared machine noise only ever adds time. CPU runs use one
thread unless --threads says otherwise (oversubscribed OpenMP threads make figures meaningless).
Caches are evicted before every timed call (--cache cold, the default): in a model the other
layers' weights evict this layer's, and a cache-hot single layer would favour small-T paths
that lose when weights come from memory. --cache hot measures the opposite case.

    python bench/bench_moe_layer.py                       # CPU fp32, writes bench/results/moe_layer.json
    python bench/bench_moe_layer.py --quick               # smoke run
    python bench/bench_moe_layer.py --device cuda --dtype bf16 --out bench/results/moe_layer_cuda.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS  # noqa: E402
from moe_runtime.dispatch.local import LocalDispatcher  # noqa: E402
from moe_runtime.kernels import KernelSet, RoutingConfig, get_kernels  # noqa: E402
from moe_runtime.load_balancer import SlotGeometry  # noqa: E402
from moe_runtime.moe.expert_kernel import expert_kernel_for  # noqa: E402
from moe_runtime.moe.expert_weights import ExpertWeights  # noqa: E402
from moe_runtime.moe.modular_moe import ModularMoE  # noqa: E402

H200_PEAK_BF16_TFLOPS = 790.0     # dense, no sparsity
H200_PEAK_HBM_TBPS = 4.8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LayerSpec:
    name: str
    hidden: int
    experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int = 0
    naive_max_tokens: int = 64


LAYERS = {
    "qwen3": LayerSpec("qwen3", hidden=512, experts=32, top_k=4, intermediate=256, naive_max_tokens=512),
    "deepseek": LayerSpec("deepseek", hidden=2048, experts=64, top_k=6, intermediate=1408,
                          shared_intermediate=1408, naive_max_tokens=64),
}


@dataclass
class Row:
    layer: str
    tokens: int
    contender: str
    ms: float
    gflops: float            # achieved GFLOP/s
    pct_peak: float          # of the measured matmul peak
    gbps: float              # weight + activation bytes / time (GB/s)
    max_abs_diff: float      # vs hf_grouped output
    speedup_vs_hf: float     # hf_grouped ms / this ms
    pct_h200_flops: float | None = None   # CUDA: of 790 TFLOP/s bf16 dense
    pct_h200_bw: float | None = None      # CUDA: of 4.8 TB/s HBM


# ------------------------------------------------------------------------------------------ layers

def expert_weights_viewing(w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
    """The runtime's ExpertWeights holding `w13` [E, 2I, H] / `w2` [E, H, I] themselves (no copy)."""
    experts = ExpertWeights(list(range(w13.shape[0])), w13.shape[2], w2.shape[2], device="meta")
    experts.w13 = torch.nn.Parameter(w13, requires_grad=False)
    experts.w2 = torch.nn.Parameter(w2, requires_grad=False)
    return experts


class Layer:
    """One HF MoE block plus views of its weights in this runtime's layout (no copies)."""

    def __init__(self, spec: LayerSpec, device: torch.device, dtype: torch.dtype, seed: int = 0):
        torch.manual_seed(seed)
        self.spec = spec
        with torch.device(device):                       # build and initialize on the target device
            self.build(spec, device, dtype)

    def build(self, spec: LayerSpec, device: torch.device, dtype: torch.dtype) -> None:
        if spec.name == "qwen3":
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
            config = Qwen3MoeConfig(hidden_size=spec.hidden, num_experts=spec.experts,
                                    num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.intermediate,
                                    norm_topk_prob=True)
            self.block = Qwen3MoeSparseMoeBlock(config)
            self.routing = RoutingConfig(top_k=spec.top_k, renormalize=True)
            self.bias = None
        else:
            from transformers import DeepseekV3Config
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
            config = DeepseekV3Config(hidden_size=spec.hidden, n_routed_experts=spec.experts,
                                      num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.intermediate,
                                      n_shared_experts=spec.shared_intermediate // spec.intermediate,
                                      n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
            self.block = DeepseekV3MoE(config)
            self.routing = RoutingConfig(top_k=spec.top_k, scoring="sigmoid", renormalize=True, num_groups=8,
                                         topk_groups=4, group_score="top2_sum", routed_scaling_factor=2.5)
        self.experts_config = config
        with torch.no_grad():
            for name, param in self.block.named_parameters():
                param.normal_(0.0, 0.02 if "gate." not in name else 0.1)
            if spec.name == "deepseek":
                self.block.gate.e_score_correction_bias.normal_(0.0, 0.05)
        self.block = self.block.to(device=device, dtype=dtype).eval()
        if spec.name == "deepseek":
            self.block.gate.float()                      # HF keeps the DeepSeek router in fp32
            self.bias = self.block.gate.e_score_correction_bias
            mlp = self.block.shared_experts
            self.shared_w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])[None]   # [1, 2I, H]
            self.shared_w2 = mlp.down_proj.weight[None]                                     # [1, H, I]
        self.gate = self.block.gate.weight                                                  # [E, H]
        self.w13 = self.block.experts.gate_up_proj.data                                     # [E, 2I, H]
        self.w2 = self.block.experts.down_proj.data                                         # [E, H, I]
        self.routed = expert_weights_viewing(self.w13, self.w2)
        self.shared = expert_weights_viewing(self.shared_w13, self.shared_w2) if spec.name == "deepseek" else None
        self.dispatcher = LocalDispatcher(SlotGeometry(spec.experts, 1), spec.hidden)

    def hf(self, x: torch.Tensor, implementation: str) -> torch.Tensor:
        self.experts_config._experts_implementation = implementation
        return self.block(x[None])[0]

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.name == "deepseek":
            return F.linear(x.float(), self.gate.float())                                   # [T, E]
        return F.linear(x, self.gate)

    def runtime(self, kernels: KernelSet, x: torch.Tensor) -> torch.Tensor:
        topk = kernels.select_experts(self.router_logits(x), self.routing, self.bias)
        weights = topk.weights if self.spec.name == "deepseek" else topk.weights.to(x.dtype).float()
        expert_kernel = expert_kernel_for(LAYOUT_CONTIGUOUS, kernels)
        y = ModularMoE(self.dispatcher, expert_kernel)(x, topk.ids, weights, self.routed)
        if self.shared is not None:
            dense_counts = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
            y = y + expert_kernel(x, dense_counts, self.shared)
        return y

    def naive(self, kernels: KernelSet, x: torch.Tensor) -> torch.Tensor:
        topk = kernels.select_experts(self.router_logits(x), self.routing, self.bias)
        intermediate = self.spec.intermediate
        y = torch.zeros_like(x)
        for token, (ids, weights) in enumerate(zip(topk.ids.tolist(), topk.weights.tolist())):
            for expert, weight in zip(ids, weights):
                gate_up = self.w13[expert] @ x[token]
                act = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
                y[token] += weight * (self.w2[expert] @ act)
        if self.spec.name == "deepseek":
            y = y + self.block.shared_experts(x)
        return y

    def flops(self, tokens: int) -> float:
        s = self.spec
        routed = 6.0 * tokens * s.top_k * s.hidden * s.intermediate
        return routed + 6.0 * tokens * s.hidden * s.shared_intermediate + 2.0 * tokens * s.hidden * s.experts

    def bytes_moved(self, tokens: int, experts_hit: int, element: int) -> float:
        s = self.spec
        weights = experts_hit * 3 * s.hidden * s.intermediate + 3 * s.hidden * s.shared_intermediate
        return float(element * (weights + s.hidden * s.experts + 2 * tokens * s.hidden))


# ---------------------------------------------------------------------------------------- timing

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CacheFlush:
    """Evicts the caches before a timed call, so weights come from memory as they do in a model
    (where the other layers' weights have evicted this one's); 256 MiB exceeds any L3/L2 here."""

    def __init__(self, device: torch.device, enabled: bool):
        self.buffer = torch.empty(64 * 2**20, device=device) if enabled else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1.0)


def time_once(fn, device, flush: CacheFlush | None = None) -> float:
    if flush is not None:
        flush()
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - started) * 1e3


def measure_peak(device: torch.device, dtype: torch.dtype) -> dict:
    """Dense matmul GFLOP/s and copy GB/s, best of a few runs."""
    size = 2048 if device.type == "cpu" else 8192
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best_ms = min(time_once(lambda: a @ b, device) for _ in range(3 if device.type == "cpu" else 10))
    src = torch.empty(64 * 2**20 // 4 if device.type == "cpu" else 2**30 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = min(time_once(lambda: dst.copy_(src), device) for _ in range(5))
    return {"matmul_gflops": 2 * size ** 3 / best_ms / 1e6, "copy_gbps": 2 * src.numel() * 4 / copy_ms / 1e6,
            "matmul_size": size}


def repeats_for(tokens: int, spec: LayerSpec, device: torch.device, quick: bool) -> int:
    if device.type == "cuda":
        return 3 if quick else 10
    work = tokens * spec.top_k * spec.hidden * spec.intermediate
    if quick:
        return 2
    return 10 if work < 5e8 else 4 if work < 5e9 else 2


def bench_layer(spec: LayerSpec, tokens_list, device, dtype, kernels, peak, quick, rows: list,
                flush: CacheFlush) -> None:
    layer = Layer(spec, device, dtype)
    element = torch.tensor([], dtype=dtype).element_size()
    torch_kernels = get_kernels(device, "torch")
    with torch.no_grad():
        for tokens in tokens_list:
            x = torch.randn(tokens, spec.hidden, device=device, dtype=dtype)
            contenders = {
                "runtime": lambda: layer.runtime(kernels, x),
                "hf_grouped": lambda: layer.hf(x, "grouped_mm"),
                "hf_eager": lambda: layer.hf(x, "eager"),
            }
            if device.type == "cuda" and kernels.name != "torch":
                contenders["runtime_torch"] = lambda: layer.runtime(torch_kernels, x)
            if tokens <= spec.naive_max_tokens:
                contenders["naive"] = lambda: layer.naive(kernels, x)
            outputs = {name: fn() for name, fn in contenders.items()}               # warm-up + outputs
            samples = {name: [] for name in contenders}
            for _ in range(repeats_for(tokens, spec, device, quick)):
                for name, fn in contenders.items():                                  # interleaved
                    samples[name].append(time_once(fn, device, flush))
            topk = kernels.select_experts(layer.router_logits(x), layer.routing, layer.bias)
            experts_hit = int(torch.unique(topk.ids).numel())
            hf_ms = min(samples["hf_grouped"])
            for name, times in samples.items():
                ms = min(times)
                gflops = layer.flops(tokens) / ms / 1e6
                gbps = layer.bytes_moved(tokens, experts_hit, element) / ms / 1e6
                on_cuda = device.type == "cuda"
                rows.append(Row(
                    layer=spec.name, tokens=tokens, contender=name, ms=ms, gflops=gflops,
                    pct_peak=100.0 * gflops / peak["matmul_gflops"],
                    gbps=gbps,
                    max_abs_diff=float((outputs[name].float() - outputs["hf_grouped"].float()).abs().max())
                    if tokens else 0.0,
                    speedup_vs_hf=hf_ms / ms,
                    pct_h200_flops=100.0 * gflops / (H200_PEAK_BF16_TFLOPS * 1e3) if on_cuda else None,
                    pct_h200_bw=100.0 * gbps / (H200_PEAK_HBM_TBPS * 1e3) if on_cuda else None,
                ))
            print_rows([row for row in rows if row.layer == spec.name and row.tokens == tokens], device,
                       header=tokens == tokens_list[0])
    del layer


def print_rows(rows, device, header: bool) -> None:
    unit, scale = ("TFLOP/s", 1e-3) if device.type == "cuda" else ("GFLOP/s", 1.0)
    h200 = device.type == "cuda"
    if header:
        print(f"{'layer':9} {'T':>5} {'contender':13} {'ms':>10} {unit:>9} {'%peak':>6} {'GB/s':>8} "
              + (f"{'%790TF':>7} {'%4.8TB/s':>8} " if h200 else "")
              + f"{'x hf_grouped':>12} {'max|diff|':>10}")
    for row in rows:
        print(f"{row.layer:9} {row.tokens:5d} {row.contender:13} {row.ms:10.3f} {row.gflops * scale:9.2f} "
              f"{row.pct_peak:6.1f} {row.gbps:8.1f} "
              + (f"{row.pct_h200_flops:7.2f} {row.pct_h200_bw:8.2f} " if h200 else "")
              + f"{row.speedup_vs_hf:12.2f} {row.max_abs_diff:10.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--layers", default="qwen3,deepseek")
    parser.add_argument("--tokens", default="1,8,64,512,2048")
    parser.add_argument("--kernels", default="auto", help="kernel family for the runtime contender")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--cache", choices=["cold", "hot"], default="cold",
                        help="cold: evict caches before each timed call (as in a model); hot: reuse them")
    parser.add_argument("--quick", action="store_true", help="one repeat, small token counts")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe_layer.json"))
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    if args.quick:
        tokens_list = [t for t in tokens_list if t <= 64]
    kernels = get_kernels(device, args.kernels)
    peak = measure_peak(device, dtype)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or platform.machine()}), "
          f"dtype {dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, kernels {kernels.name}, "
          f"{args.cache} caches")
    print(f"measured peak: matmul {peak['matmul_gflops']:.1f} GFLOP/s ({peak['matmul_size']}^3), "
          f"copy {peak['copy_gbps']:.1f} GB/s")
    if device.type == "cuda":
        print(f"H200 nominal: {H200_PEAK_BF16_TFLOPS:.0f} TFLOP/s bf16 dense, {H200_PEAK_HBM_TBPS} TB/s HBM "
              f"(measured: {peak['matmul_gflops'] / 1e3:.0f} TFLOP/s, {peak['copy_gbps'] / 1e3:.2f} TB/s)")

    rows: list[Row] = []
    started = time.perf_counter()
    for name in args.layers.split(","):
        if name not in LAYERS:
            raise SystemExit(f"--layers: unknown layer {name!r}, expected some of {sorted(LAYERS)}")
        bench_layer(LAYERS[name], tokens_list, device, dtype, kernels, peak, args.quick, rows,
                    CacheFlush(device, args.cache == "cold"))
    elapsed = time.perf_counter() - started

    print("\nruntime vs transformers (hf_grouped / hf_eager ms over runtime ms):")
    for row in rows:
        if row.contender == "runtime":
            eager = next(r for r in rows if r.layer == row.layer and r.tokens == row.tokens and r.contender == "hf_eager")
            print(f"  {row.layer:9} T={row.tokens:5d}: {row.speedup_vs_hf:5.2f}x vs grouped_mm, "
                  f"{eager.ms / row.ms:5.2f}x vs eager")
    print(f"total {elapsed:.0f} s")

    result = {
        "benchmark": "moe_layer",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "dtype": str(dtype),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": kernels.name,
        "caches": args.cache,
        "measured_peak": peak,
        "nominal_peak": {"bf16_tflops": H200_PEAK_BF16_TFLOPS, "hbm_tbps": H200_PEAK_HBM_TBPS}
        if device.type == "cuda" else None,
        "layers": {name: asdict(LAYERS[name]) for name in args.layers.split(",")},
        "rows": [asdict(row) for row in rows],
        "seconds": elapsed,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
