"""Rotary embedding over the first `rotary_dim` channels of each head, the rest passed through unrotated.

GLM-4.5 (partial_rotary_factor 0.5) and MiniMax-M2 (rotary_dim 64 of head_dim 128) rotate only part of
each q/k head, as transformers' `apply_rotary_pos_emb` does when its cos/sin are narrower than the head:
the leading `rotary_dim` channels rotate (neox halves), the trailing ones keep their values.
"""
from __future__ import annotations

import torch

from moe_runtime.layers.rotary import RotaryEmbedding


def partial_rotary_dim(hf_config, head_dim: int) -> int:
    """transformers' rule: int(head_dim * partial_rotary_factor), the factor from rope_parameters (MiniMax-M2's
    config turns its `rotary_dim` into that factor), 1.0 when absent."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


class PartialRotaryEmbedding(RotaryEmbedding):
    """A `RotaryEmbedding` whose frequencies cover fewer channels than the head: only those rotate."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_dim = 2 * self.inv_freq.shape[0]
        cos, sin = self.cos_sin(positions, q.dtype)                                  # [T, 1, R/2]
        q_rot = self.rotate(q[..., :rotary_dim], cos, sin)                            # [T, hq, R]
        k_rot = self.rotate(k[..., :rotary_dim], cos, sin)                            # [T, hkv, R]
        return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)
