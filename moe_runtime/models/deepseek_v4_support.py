"""What the DeepSeek-V4 implementation does not run yet, refused at start-up by name (never run wrong).

Built: one rank, expert parallelism with DP attention, attention TP (whole output groups per rank), pipeline stages,
two-batch overlap, chunked prefill, prefix caching (the per-sequence state snapshotted at block boundaries), P/D
(each layer's entries travel with the blocks, its state with the slot: moe_runtime/disaggregation/kv_transfer/
shard.py), n-gram speculative decoding (the state rings keep room for a verify step's drafts), MTP drafting with the
checkpoint's `mtp.0.*` layer (moe_runtime/models/deepseek_v4_mtp.py: its state in a slot of its own; one rank, EP
with DP attention or attention TP, pipeline stages), every expert kernel family (its clamped SiLU in each; the
attention itself is torch code), DeepSeek's release format (FP8 block linears, FP4 experts: moe_runtime/weights/
quantization/deepseek_fp4_format.py) dequantized at load, or its experts kept in FP4 with `--quantization mxfp4`.
Refused here: captured decode steps, EAGLE-3 heads, linears kept quantized (`--quantization fp8 / int8`), and an
`expert_dtype` other than fp4 / fp8; context parallelism and attention TP that would cut an output group are
refused by ParallelLayout.validate (moe_runtime/config/parallel_layout.py), which the planner asks too.
"""
from __future__ import annotations

import math

from moe_runtime.errors import InvalidRequestError, UnsupportedArchitectureError
from moe_runtime.weights.quantization.deepseek_fp4_format import EXPERT_DTYPES, declared_expert_dtype

SUPPORTED_ATTENTION = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def refuse_unsupported(cfg, ctx) -> None:
    """InvalidRequestError naming the first layout or option a DeepSeek-V4 engine cannot run; checkpoint formats and
    config values it does not implement as UnsupportedArchitectureError."""
    expert_dtype = declared_expert_dtype(cfg)
    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        raise UnsupportedArchitectureError(f"DeepSeek-V4 checkpoint with expert_dtype={expert_dtype!r}: not "
                                           f"implemented (implemented: {EXPERT_DTYPES})")
    unknown = sorted(set(cfg.layer_types) - set(SUPPORTED_ATTENTION))
    if unknown:
        raise UnsupportedArchitectureError(f"DeepSeek-V4 layer_types {unknown}: not implemented "
                                           f"(implemented: {SUPPORTED_ATTENTION})")
    if cfg.num_key_value_heads != 1:
        raise UnsupportedArchitectureError(f"DeepSeek-V4 with num_key_value_heads={cfg.num_key_value_heads}: its "
                                           "attention is shared-KV MQA (one KV head), nothing else is implemented")
    if ctx.quant is not None and ctx.quant.name != "mxfp4":   # mxfp4 keeps the experts only, as the release does
        raise InvalidRequestError(f"--quantization {ctx.quant.name} with DeepSeek-V4: not implemented (its experts "
                                  "can be kept in FP4: --quantization mxfp4)")
    engine = ctx.engine
    if engine is None:
        return
    if engine.enable_torch_compile:
        raise InvalidRequestError("--enable-torch-compile with DeepSeek-V4: not implemented (a captured decode step "
                                  "does not take its per-sequence compressor state yet)")
    speculative = engine.speculative_config or {}
    if speculative.get("method") == "eagle3":
        raise InvalidRequestError("speculative_config method 'eagle3' with DeepSeek-V4: not implemented; an EAGLE-3 "
                                  "head reads one residual stream entering each of three layers, and V4 carries "
                                  "hc_mult hyper-connected streams there; use method 'mtp' (its own layer) or 'ngram'")
    rates = sorted({cfg.compress_rates[kind] for kind in cfg.layer_types if kind in cfg.compress_rates})
    uneven = [rate for rate in rates if engine.block_size % rate]
    if uneven:
        raise InvalidRequestError(
            f"--block-size {engine.block_size} with DeepSeek-V4: each block pages the compressed entries of its "
            f"tokens, so it must be a multiple of every compression rate {rates}; use --block-size "
            f"{math.lcm(engine.block_size, *rates)}")
