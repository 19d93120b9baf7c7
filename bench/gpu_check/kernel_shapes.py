"""What gpu_check's `kernels` part measures on and with: shapes (DeepSeek-V3 on the GPU, small ones in the
dry run), tolerances, generated inputs and weights, the comparison, and timing.

The edge cases (empty batches, masked slots, duplicates, odd block sizes) are not restated here: the
`kernel_cases` part runs tests/triton_kernel_cases.py itself. This file adds the real shapes, and the
inputs come from that file's generators (`moe_inputs` for top-k ids and weights).

DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): hidden 7168, 256 routed experts, top-8 in
8 groups of which 4 are kept (sigmoid scores + e_score_correction_bias, groups by top-2 sum),
routed_scaling_factor 2.5, moe_intermediate_size 2048, 128 attention heads, MLA with
kv_lora_rank 512 + qk_rope_head_dim 64 = 576 cached per token (absorbed decode attends over the
576-dim latent and reads the first 512 as values), q_lora_rank 1536.

Comparison: a kernel's output against its reference under a stated tolerance, with the figures to
report. Timing: wall-clock time of a device call, best of a few runs after a warm-up, synchronized on
CUDA. Best-of, not mean: on a shared machine noise only ever adds time. Figures are reported as
ratios against the alternative (the torch twin, transformers), never asserted.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable

import torch

from moe_runtime.kernels import KernelSet, RoutingConfig
from moe_runtime.kernels.int4_layout import Int4Layout
from moe_runtime.kernels.routing import group_mask
from moe_runtime.weights.quantization.fp8_in_memory import ONLINE_BLOCK_K, quantize_rows
from moe_runtime.weights.quantization.int4_in_memory import int4_rows, quantize_int4
from moe_runtime.weights.quantization.int8_in_memory import quantize_int8_rows
from moe_runtime.kernels.mxfp4_weights import quantize_mxfp4
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows


# ------------------------------------------------------------------------------- shapes and tolerances

@dataclass(frozen=True)
class Tolerance:
    """Elementwise: |got - want| <= atol + rtol * |want| (torch.testing.assert_close's rule)."""

    rtol: float
    atol: float

    def __str__(self) -> str:
        return f"rtol={self.rtol:g}, atol={self.atol:g}"


# Kernel -> dtype of its inputs -> tolerance against the torch twin run in fp32 on the same rounded
# inputs (rms_norm: the twin in the same dtype, whose rounding is the definition: HF semantics).
# Integer outputs (ids, permutations, tile schedules) must be equal; `select_experts`' weights are
# fp32 math whatever the logits' dtype.
GEMM = {"float32": Tolerance(1e-4, 1e-4), "float16": Tolerance(5e-3, 5e-3), "bfloat16": Tolerance(3e-2, 3e-2)}
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "select_experts": {dtype: Tolerance(1e-5, 1e-6) for dtype in ("float32", "float16", "bfloat16")},
    "fused_moe": GEMM,            # bf16: the [rows, I] activation is rounded to bf16 between the GEMMs
    "expert_mlp": GEMM,
    "pair_expert_mlp": GEMM,      # fp32 accumulation per pair; the sum over K in fp32, rounded once
    "linear_rows": GEMM,
    "masked_expert_mlp": GEMM,
    "fp8_expert_mlp": GEMM,       # FP8 weights: both sides dequantize the same bytes with the same scales
    "fp8_masked_expert_mlp": GEMM,
    "fp8_linear": GEMM,
    "int8_expert_mlp": GEMM,      # int8 weights: both sides convert the same bytes and apply the same row scales
    "int8_masked_expert_mlp": GEMM,
    "int8_linear": GEMM,
    "mxfp4_expert_mlp": GEMM,     # MXFP4 weights: both sides decode the same nibbles with the same e8m0 scales
    "mxfp4_masked_expert_mlp": GEMM,
    "mxfp4_linear": GEMM,
    "int4_expert_mlp": GEMM,      # int4 weights: both sides decode the same codes with the same scales and zeros
    "int4_masked_expert_mlp": GEMM,
    "int4_linear": GEMM,
    "unpermute_reduce": {"float32": Tolerance(1e-5, 1e-5), "float16": Tolerance(2e-3, 2e-3),
                         "bfloat16": Tolerance(1e-2, 1e-2)},   # one rounding of the fp32 sum
    "rms_norm": {"float32": Tolerance(1e-5, 1e-5), "float16": Tolerance(4e-3, 4e-3),
                 "bfloat16": Tolerance(2e-2, 2e-2)},           # 1 ulp of bf16 is up to 2**-7 relative
    "fused_add_rms_norm": {"float32": Tolerance(1e-5, 1e-5), "float16": Tolerance(4e-3, 4e-3),
                           "bfloat16": Tolerance(2e-2, 2e-2)},  # and the residual sum must be equal
    "paged_decode_attention": {"float32": Tolerance(1e-4, 1e-4), "float16": Tolerance(4e-3, 4e-3),
                               "bfloat16": Tolerance(2e-2, 2e-2)},
    "skinny_matmul": {"float32": Tolerance(1e-5, 1e-5), "float16": Tolerance(1e-3, 1e-3),
                      "bfloat16": Tolerance(1e-2, 1e-2)},
}
ROUTING_TIE_MARGIN = 1e-5   # tokens whose choice has a near-tie below this may pick either expert


@dataclass(frozen=True)
class RoutingCase:
    name: str
    experts: int
    config: RoutingConfig
    correction_bias: bool = False


@dataclass(frozen=True)
class ExpertShape:
    """One MoE layer's routed experts, run on one rank (all experts local)."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int


@dataclass(frozen=True)
class MaskedShape:
    """DeepEP low-latency's layout on one rank: [local experts, capacity, hidden]."""

    name: str
    local_experts: int
    capacity: int


@dataclass(frozen=True)
class NormShape:
    name: str
    hidden: int


@dataclass(frozen=True)
class AttentionShape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    block_size: int
    shared_kv: bool = False      # MLA: values are the first v_dim entries of the cached latent


@dataclass(frozen=True)
class KernelShapes:
    routing: tuple[RoutingCase, ...]
    routing_tokens: tuple[int, ...]
    routing_dtypes: tuple[str, ...]
    experts: ExpertShape
    expert_tokens: tuple[int, ...]
    masked: MaskedShape
    norms: tuple[NormShape, ...]
    norm_tokens: tuple[int, ...]
    attention: tuple[AttentionShape, ...]
    context_lens: tuple[int, ...]       # one decode batch: each sequence's context length
    skinny_rows: tuple[int, ...]
    dtypes: tuple[str, ...]             # of every kernel but routing; () = the run's 16-bit dtype only
    timed: bool                         # measure Triton vs the torch twin (not in the interpreter)


DEEPSEEK_V3_ROUTING = RoutingConfig(top_k=8, scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4,
                                    group_score="top2_sum", routed_scaling_factor=2.5)

# Decode contexts: block boundaries (15, 16, 17 with block 16), one token, the longest, and a seeded spread.
_REAL_CONTEXTS = (1, 15, 16, 17, 100, 1000, 2047, 4096, 3011, 77, 512, 1500, 2222, 3900, 64, 257,
                  4000, 9, 1234, 2900, 333, 3333, 640, 48, 1777, 2600, 3100, 700, 31, 4095, 2048, 1025)

GPU_SHAPES = KernelShapes(
    routing=(
        RoutingCase("deepseek_v3", 256, DEEPSEEK_V3_ROUTING, correction_bias=True),
        RoutingCase("deepseek_v2", 160, RoutingConfig(top_k=6, num_groups=8, topk_groups=3, group_score="max",
                                                      routed_scaling_factor=16.0)),
        RoutingCase("qwen3_moe_235b", 128, RoutingConfig(top_k=8, renormalize=True)),
        RoutingCase("mixtral_8x22b", 8, RoutingConfig(top_k=2, renormalize=True)),
    ),
    routing_tokens=(1, 4096),
    routing_dtypes=("float32", "bfloat16"),      # the engine's router logits are fp32; bf16 as asked
    experts=ExpertShape("deepseek_v3", hidden=7168, intermediate=2048, experts=256, top_k=8),
    expert_tokens=(1, 64, 4096),                 # decode at batch 1 and 64 (block_m 16), prefill (block_m 64)
    masked=MaskedShape("deepseek_v3_ep8", local_experts=32, capacity=256),
    norms=(NormShape("hidden_7168", 7168), NormShape("q_lora_1536", 1536), NormShape("kv_lora_512", 512)),
    norm_tokens=(1, 4096),
    attention=(
        AttentionShape("gqa_qwen3_235b", q_heads=64, kv_heads=4, head_dim=128, v_dim=128, block_size=16),
        AttentionShape("mla_16_heads", q_heads=16, kv_heads=1, head_dim=576, v_dim=512, block_size=16,
                       shared_kv=True),         # attention TP 8
        # DP attention: a rank holds all 128 heads. Last: one program holds a [128, 1024] query tile
        # (576 padded to a power of two), which may exceed shared memory or spill; if it hangs, only
        # this check is cut by the part's timeout.
        AttentionShape("mla_128_heads", q_heads=128, kv_heads=1, head_dim=576, v_dim=512, block_size=16,
                       shared_kv=True),
    ),
    context_lens=_REAL_CONTEXTS,
    skinny_rows=(1, 2, 8, 64),
    dtypes=("bfloat16",),                        # the edge cases (kernel_cases) add fp32
    timed=True,
)

DRY_RUN_SHAPES = KernelShapes(
    routing=(
        RoutingCase("deepseek_v3_small", 16, RoutingConfig(top_k=4, scoring="sigmoid", renormalize=True, num_groups=4,
                                                           topk_groups=2, group_score="top2_sum",
                                                           routed_scaling_factor=2.5), correction_bias=True),
        RoutingCase("qwen3_moe_small", 8, RoutingConfig(top_k=2, renormalize=True)),
    ),
    routing_tokens=(13,),
    routing_dtypes=("float32", "float16"),
    experts=ExpertShape("deepseek_v3_small", hidden=64, intermediate=32, experts=16, top_k=4),
    expert_tokens=(1, 13),                       # the interpreter runs every tile in Python: keep them few
    masked=MaskedShape("small_ep", local_experts=4, capacity=8),
    norms=(NormShape("hidden_64", 64), NormShape("latent_48", 48)),
    norm_tokens=(1, 6),
    attention=(
        AttentionShape("mla_16_heads_small", q_heads=16, kv_heads=1, head_dim=40, v_dim=32, block_size=4,
                       shared_kv=True),         # 16 heads per KV head: the tl.dot path
        AttentionShape("mla_4_heads_small", q_heads=4, kv_heads=1, head_dim=40, v_dim=32, block_size=4,
                       shared_kv=True),
        AttentionShape("gqa_small", q_heads=8, kv_heads=2, head_dim=16, v_dim=16, block_size=4),
    ),
    context_lens=(1, 3, 4, 5, 17),
    skinny_rows=(1, 2, 8),
    dtypes=("float16",),                         # the bf16 stand-in; fp32 runs in kernel_cases
    timed=False,
)

TINY_SHAPES = KernelShapes(                      # one case per kernel, as few tiles as still mean something
    routing=DRY_RUN_SHAPES.routing[:1],
    routing_tokens=(5,),
    routing_dtypes=("float32",),
    experts=DRY_RUN_SHAPES.experts,
    expert_tokens=(5,),
    masked=DRY_RUN_SHAPES.masked,
    norms=DRY_RUN_SHAPES.norms[:1],
    norm_tokens=(6,),
    attention=DRY_RUN_SHAPES.attention[:1],
    context_lens=(1, 5, 17),
    skinny_rows=(2,),
    dtypes=(),
    timed=False,
)


def shapes_for(dry_run: bool, tiny: bool) -> KernelShapes:
    if tiny:
        return TINY_SHAPES
    return DRY_RUN_SHAPES if dry_run else GPU_SHAPES


# ---------------------------------------------------------------------------------- inputs and weights

@dataclass
class ExpertWeights:
    """One layer's stacked experts in the check's dtype, and fp32 copies for the reference."""

    w13: torch.Tensor       # [E, 2I, H]
    w2: torch.Tensor        # [E, H, I]
    w13_fp32: torch.Tensor
    w2_fp32: torch.Tensor


@dataclass(frozen=True)
class QuantizedFormat:
    """A `--quantization` weight format as the checks use it: how an expert stack is quantized, and the
    extra arguments its kernels take. Its kernels are the KernelSet fields `{name}_linear`,
    `{name}_expert_mlp` and `{name}_masked_expert_mlp`."""

    name: str                                          # "fp8" | "int8" | "mxfp4" | "int4"
    quantize: Callable[[torch.Tensor], QuantizedRows]  # one expert's [N, K] -> values and scales
    kernel_args: tuple = ()                            # after the weights: FP8's block_k
    details: tuple = ()                                # (key, value) pairs the expert / linear reports add
    kernel_kwargs: tuple = ()                          # (keyword, value) pairs every kernel takes: int4's layout
    triton_kernel: bool = True                         # False: the Triton family runs the torch twin's kernels

    def kernel(self, kernel_set: KernelSet, kind: str) -> Callable:
        """`kind`: "linear", "expert_mlp" or "masked_expert_mlp"; the format's keyword arguments bound."""
        kernel = getattr(kernel_set, f"{self.name}_{kind}")
        return partial(kernel, **dict(self.kernel_kwargs)) if self.kernel_kwargs else kernel


FP8 = QuantizedFormat("fp8", lambda weight: quantize_rows(weight, ONLINE_BLOCK_K), (ONLINE_BLOCK_K,),
                      (("block_k", ONLINE_BLOCK_K),))   # row-expanded 128-column scales
INT8 = QuantizedFormat("int8", quantize_int8_rows, triton_kernel=False)     # one fp32 scale per row
# int4 with zero points (AWQ, GPTQ, asymmetric compressed-tensors) in groups of 32 (Kimi K2's size): the general
# decode, several groups a row at every shape here; the Triton family runs the torch kernels (no Triton int4 yet)
INT4_LAYOUT = Int4Layout(group_size=32, zero_points=True)
INT4 = QuantizedFormat("int4", lambda weight: int4_rows(quantize_int4(weight, INT4_LAYOUT)),
                       details=(("group_size", INT4_LAYOUT.group_size), ("zero_points", INT4_LAYOUT.zero_points)),
                       kernel_kwargs=(("layout", INT4_LAYOUT),), triton_kernel=False)
MXFP4 = QuantizedFormat("mxfp4", lambda weight: QuantizedRows(*quantize_mxfp4(weight)))   # e2m1, e8m0 per 32


@dataclass
class QuantizedExpertWeights:
    """The same experts quantized as `--quantization <format>` keeps them."""

    w13: torch.Tensor        # [E, 2I, H] in the format's values dtype
    w13_scale: torch.Tensor  # fp8 [E, 2I, ceil(H/128)], int8 [E, 2I] fp32
    w2: torch.Tensor         # [E, H, I]
    w2_scale: torch.Tensor   # fp8 [E, H, ceil(I/128)], int8 [E, H] fp32

    @classmethod
    def of(cls, weights: ExpertWeights, fmt: QuantizedFormat) -> "QuantizedExpertWeights":
        def quantized(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows = [fmt.quantize(expert) for expert in stack]   # one expert at a time: memory
            return torch.stack([r.values for r in rows]), torch.stack([r.scales for r in rows])

        return cls(*quantized(weights.w13_fp32), *quantized(weights.w2_fp32))

    def first(self, experts: int) -> tuple[torch.Tensor, ...]:
        return self.w13[:experts], self.w13_scale[:experts], self.w2[:experts], self.w2_scale[:experts]


def distinct_logits(tokens: int, experts: int, generator: torch.Generator) -> torch.Tensor:
    """[T, E] fp32: a random permutation of evenly spaced values per token, exact in bf16 and fp16
    (integers times a power of two), so neither implementation meets a tie in its inputs."""
    step = 2.0 ** -math.floor(math.log2(max(experts / 8, 1)))
    order = torch.rand(tokens, experts, generator=generator).argsort(dim=-1).float()
    return (order - experts // 2) * step


def routing_margins(logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """[T]: the smallest gap at a decision the router makes (kept groups, then the top-k) per token.
    Below ROUTING_TIE_MARGIN the two implementations may rightly pick different experts."""
    scores = logits.softmax(dim=-1) if config.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    inf = torch.full((logits.shape[0],), float("inf"), device=logits.device)
    margin = inf
    if config.num_groups > 1:
        grouped = choice.view(logits.shape[0], config.num_groups, -1)
        group_scores = grouped.max(-1).values if config.group_score == "max" else grouped.topk(2, -1).values.sum(-1)
        if config.topk_groups < config.num_groups:
            top = group_scores.topk(config.topk_groups + 1, dim=-1).values
            margin = torch.minimum(margin, top[:, -2] - top[:, -1])
        choice = choice.masked_fill(~group_mask(choice, config), float("-inf"))
    if config.top_k < choice.shape[1]:
        top = choice.topk(config.top_k + 1, dim=-1).values
        gap = top[:, -2] - top[:, -1]
        margin = torch.minimum(margin, torch.where(torch.isfinite(gap), gap, inf))
    return margin


# ------------------------------------------------------------------------------------------ comparison

@dataclass
class Comparison:
    tolerance: str
    violations: int          # elements outside atol + rtol * |want| (non-finite ones included)
    elements: int
    max_abs_err: float
    max_rel_err: float       # max |got - want| / max |want|
    rel_l2_err: float        # ||got - want|| / ||want||
    max_abs_want: float

    @property
    def ok(self) -> bool:
        return self.violations == 0

    def problem(self, what: str) -> str | None:
        if self.ok:
            return None
        return (f"{what}: {self.violations} of {self.elements} elements outside {self.tolerance} "
                f"(max |err| {self.max_abs_err:.3g}, max |want| {self.max_abs_want:.3g})")

    def as_details(self) -> dict:
        return asdict(self)


def compare(got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance) -> Comparison:
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    got32, want32 = got.detach().float(), want.detach().to(got.device).float()
    if got32.numel() == 0:
        return Comparison(str(tolerance), 0, 0, 0.0, 0.0, 0.0, 0.0)
    diff = (got32 - want32).abs()
    outside = ~(diff <= tolerance.atol + tolerance.rtol * want32.abs())       # NaN counts as outside
    scale = float(want32.abs().max())
    max_abs = float(torch.nan_to_num(diff, nan=float("inf")).max())
    norm = float(torch.linalg.vector_norm(want32))
    return Comparison(
        tolerance=str(tolerance), violations=int(outside.sum()), elements=got32.numel(), max_abs_err=max_abs,
        max_rel_err=max_abs / scale if scale else max_abs,
        rel_l2_err=float(torch.linalg.vector_norm(torch.nan_to_num(got32 - want32, nan=float("inf")))) / norm
        if norm else 0.0,
        max_abs_want=scale,
    )


# ---------------------------------------------------------------------------------------------- timing

def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_ms(fn, device: torch.device | str, repeats: int = 5) -> float:
    fn()                                                   # warm-up (and Triton's compile)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - started) * 1e3)
    return best
