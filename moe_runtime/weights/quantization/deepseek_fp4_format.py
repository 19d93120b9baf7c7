"""DeepSeek-V4 as released: FP8 block linears with e8m0 scales, and routed experts in packed FP4.

DeepSeek-V4-Flash / -Pro declare `quantization_config: {quant_method: fp8, fmt: e4m3, scale_fmt: ue8m0,
weight_block_size: [128, 128], activation_scheme: dynamic}` and `expert_dtype: fp4` (V4.1 moves `expert_dtype`
into quantization_config; `fp8` is -Base's, whose experts are FP8 blocks like every other linear). Stored:

- linears (attention, indexer queries, shared experts): float8_e4m3fn `<linear>.weight` [N, K] with
  `<linear>.scale` [ceil(N/128), ceil(K/128)], one power of two per block (float8_e8m0fnu; uint8 exponents and
  float32 scales read too). `.scale` is transformers' `weight_scale_inv` (moe_runtime/models/deepseek_v4.py's
  `checkpoint_name` renames it), so fp8_block.py reads these, with `block_scales_as_float` for the e8m0 scales.
- routed experts (`layers.L.ffn.experts.E.w1 / w2 / w3`): int8 `weight` [N, K/2], two e2m1 codes a byte (the
  low nibble is column 2j, the high one 2j + 1) and `scale` [N, K/32] e8m0, one power of two per 32 columns of a
  row (`PackedFp4`). That is MXFP4's layout byte for byte (moe_runtime/kernels/mxfp4_weights.py): decoded
  exactly at load by default, kept as stored by `--quantization mxfp4`.
- in BF16 / FP32 without scales: embeddings, head, routers, norms, hyper-connections, sinks, and the
  compressors' and indexer's kv / gate / weights projections (transformers' `_keep_in_fp32_modules`).

transformers reads an int8 weight with block scales in an fp8 checkpoint as FP4, whatever the config says
(integrations/finegrained_fp8.py, `Fp8Dequantize`); so does the reader (`CheckpointReader.is_fp4`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.mxfp4_weights import E8M0_BIAS, MXFP4_BLOCK, dequantize_mxfp4, e8m0_to_float
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows

EXPERT_DTYPES = ("fp4", "fp8")   # config.json's `expert_dtype` values transformers knows
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)


def is_e8m0(scales: torch.Tensor) -> bool:
    """Whether stored scales are e8m0 exponents (float8_e8m0fnu, or their bytes as uint8)."""
    return scales.dtype == torch.uint8 or (E8M0_DTYPE is not None and scales.dtype == E8M0_DTYPE)


def block_scales_as_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 block scales from stored ones: e8m0 exponents decoded exactly (2^(byte - 127)), floats as they are."""
    if is_e8m0(scales):
        return e8m0_to_float(scales.view(torch.uint8))
    return scales.float()


def e8m0_bytes(scales: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 e8m0 exponents of stored scales; float scales only where each is a power of two (else refused)."""
    if is_e8m0(scales):
        return scales.view(torch.uint8)
    values = scales.float()
    mantissa, exponent = torch.frexp(values)                    # values = mantissa * 2^exponent, mantissa in [0.5, 1)
    biased = exponent - 1 + E8M0_BIAS
    if not bool(((mantissa == 0.5) & (biased >= 0) & (biased <= 254)).all()):
        raise CheckpointError(f"{name}: FP4 scales of dtype {scales.dtype} that are not all powers of two "
                              "(2^-127 .. 2^127): not an e8m0 format this runtime reads")
    return biased.to(torch.uint8)


@dataclass(frozen=True)
class PackedFp4:
    """One FP4 weight [N, K] as DeepSeek stores it: values uint8 [N, K/2] (two e2m1 codes a byte, low nibble
    first), scales uint8 [N, K/32] (e8m0 exponents of 32-column blocks): MXFP4's layout."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def columns(self) -> int:
        return self.values.shape[-1] * 2

    @classmethod
    def from_stored(cls, weight: torch.Tensor, scale: torch.Tensor, name: str) -> "PackedFp4":
        """`<name>` (int8 [N, K/2]) and its scales ([N, K/32]) as the checkpoint holds them, checked."""
        if weight.dtype not in (torch.int8, torch.uint8) or weight.dim() != 2:
            raise CheckpointError(f"{name}: FP4 weight must be int8 [N, K/2] (two e2m1 codes a byte), got "
                                  f"{weight.dtype} {tuple(weight.shape)}")
        rows, packed = weight.shape
        if (packed * 2) % MXFP4_BLOCK or tuple(scale.shape) != (rows, packed * 2 // MXFP4_BLOCK):
            raise CheckpointError(f"{name}: FP4 weight {tuple(weight.shape)} (K = {packed * 2}) needs scales of shape "
                                  f"{(rows, packed * 2 // MXFP4_BLOCK)} (one per {MXFP4_BLOCK} columns of a row, K a "
                                  f"multiple of {MXFP4_BLOCK}), got {tuple(scale.shape)}")
        return cls(weight.view(torch.uint8), e8m0_bytes(scale, name))

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K], exact: e2m1 value times its block's power of two."""
        return dequantize_mxfp4(self.values, self.scales, self.columns)

    def as_mxfp4(self) -> QuantizedRows:
        """The stored bytes as `--quantization mxfp4` keeps them (moe_runtime/weights/quantization/mxfp4_in_memory.py)."""
        return QuantizedRows(self.values, self.scales)


def declared_expert_dtype(hf_config) -> str | None:
    """`expert_dtype` as V4.1 (inside quantization_config) or V4 (top level) declares it; None when neither does."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    declared = (quant or {}).get("expert_dtype")
    return declared if declared is not None else getattr(hf_config, "expert_dtype", None)
