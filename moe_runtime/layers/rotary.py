"""Rotary position embeddings: the same inverse frequencies and scaling as transformers.

Two layouts: `neox` rotates halves (Llama family); `interleaved` rotates adjacent pairs
(DeepSeek) and writes the result as [even', odd'] halves, which preserves every q.k product.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inverse_frequencies(hf_config, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2], attention_scaling), as transformers computes them."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"config.json rope_parameters.rope_type={rope_type!r} is not supported (supported: {STATIC_ROPE_TYPES})"
        )
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))
        return inv_freq, 1.0
    # transformers' own function, so YaRN's frequencies and attention factor (explicit `attention_factor`, else from
    # `factor` and `mscale` / `mscale_all_dim`) and its `truncate` flag (gpt-oss: false) are exactly transformers'.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    if inv_freq.numel() != rotary_dim // 2:   # it sizes them from head_dim * partial_rotary_factor, not rotary_dim
        raise UnsupportedArchitectureError(
            f"rope_type={rope_type!r} gives {inv_freq.numel()} frequencies from the config's head_dim and "
            f"partial_rotary_factor, but the model rotates {rotary_dim} channels ({rotary_dim // 2} frequencies)"
        )
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, interleaved: bool):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]
        self.attention_scaling = attention_scaling
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated [T, heads, D]."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
