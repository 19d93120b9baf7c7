"""MXFP4 checkpoints as gpt-oss publishes them (`quantization_config: {quant_method: mxfp4}`).

Only the routed experts are quantized (transformers' Mxfp4HfQuantizer: `gate_up_proj` and
`down_proj` of each MoE block); attention, router, embeddings and norms are stored in bf16. A
quantized expert stack `<name>` (logically [E, K, N] in transformers' parameter layout, e.g.
`gate_up_proj` [E, H, 2I]) is stored as two tensors in the OUTPUT-major orientation:

- `<name>_blocks` uint8 [E, N, G, 16]: row n's columns k = 32g + 2j (low nibble of byte j) and
  32g + 2j + 1 (high nibble), e2m1 codes;
- `<name>_scales` uint8 [E, N, G]: e8m0 exponents, block g of row n times 2^(scale - 127).

Dequantized it is [E, N, G*32] transposed to [E, K, N] (`convert_moe_packed_tensors`), which is
what the reader hands out for `<name>` so that a dequantized (bf16) gpt-oss checkpoint and an MXFP4
one load through the same code. For `--quantization mxfp4` the stored bytes are kept as they are
(`read_packed`): a row's [G, 16] blocks flattened are exactly moe_runtime/kernels/mxfp4_weights.py's layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.kernels.mxfp4_weights import dequantize_mxfp4
from moe_runtime.errors import CheckpointError

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
QUANT_METHOD = "mxfp4"


def declares_mxfp4(hf_config) -> bool:
    """Whether config.json's quantization_config says MXFP4 (the only keys it carries besides the method are
    `modules_to_not_convert`, which the tensor names already tell)."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return False
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    return quant.get("quant_method") == QUANT_METHOD


@dataclass(frozen=True)
class PackedMxfp4:
    """Rows of one stored MXFP4 tensor, as stored: values [..., N, G*16] uint8, scales [..., N, G] uint8."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def columns(self) -> int:
        return self.scales.shape[-1] * 32

    @classmethod
    def from_stored(cls, blocks: torch.Tensor, scales: torch.Tensor, name: str) -> "PackedMxfp4":
        """blocks [..., N, G, 16] and scales [..., N, G] as the checkpoint holds them, checked."""
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != 16
                or tuple(blocks.shape[:-1]) != tuple(scales.shape)):
            raise CheckpointError(f"MXFP4 tensor {name!r}: {name}{BLOCKS_SUFFIX} must be uint8 [..., N, G, 16] and "
                                  f"{name}{SCALES_SUFFIX} uint8 [..., N, G], got {blocks.dtype} {tuple(blocks.shape)} "
                                  f"and {scales.dtype} {tuple(scales.shape)}")
        return cls(blocks.flatten(-2), scales)

    def dequantized(self) -> torch.Tensor:
        """[..., N, G*32] -> transformers' parameter layout [..., K, N] (K = G*32), float32, exact."""
        return dequantize_mxfp4(self.values, self.scales, self.columns).transpose(-1, -2)
