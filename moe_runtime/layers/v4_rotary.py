"""DeepSeek-V4's rotary embedding: adjacent channel pairs of the last `rotary_dim` channels, in place.

Unlike `RotaryEmbedding(interleaved=True)`, which writes the rotated pairs back as [even', odd'] halves (harmless
where only q.k products are read), V4 keeps the channel order: its keys are also its values (K = V), the compressed
entries are values too, and the attention output's rotary channels are rotated back (`unrotate`) before the output
projection reads them in the checkpoint's order. Two bases: "main" (sliding-only layers) and "compress" (the
compressing layers and their compressors and indexers), each from the config's `rope_parameters[label]`.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError

V4_ROPE_TYPES = ("default", "yarn")


def v4_inverse_frequencies(hf_config, label: str) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention scaling) of rope label "main" or "compress", as transformers'
    DeepseekV4RotaryEmbedding computes them."""
    params = hf_config.rope_parameters[label]
    rope_type = params.get("rope_type", "default")
    if rope_type not in V4_ROPE_TYPES:
        raise UnsupportedArchitectureError(f"config.json rope_parameters[{label!r}].rope_type={rope_type!r} is not "
                                           f"supported for DeepSeek-V4 (supported: {V4_ROPE_TYPES})")
    if rope_type == "default":
        dim = int(hf_config.head_dim * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, layer_type=label)
    return inv_freq.float(), float(scaling)


class V4Rotary(nn.Module):
    def __init__(self, hf_config, label: str, device):
        super().__init__()
        inv_freq, self.scaling = v4_inverse_frequencies(hf_config, label)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)   # [R/2]
        self.rotary_dim = 2 * inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:  # [N] -> [N, 1, R/2]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return (freqs.cos() * self.scaling).to(dtype)[:, None, :], (freqs.sin() * self.scaling).to(dtype)[:, None, :]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [N, heads, D] with its last rotary_dim channels rotated by position [N] (`inverse`: by -position)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if inverse:
            sin = -sin
        rd = self.rotary_dim
        nope, rope = x[..., :-rd], x[..., -rd:]
        even, odd = rope[..., 0::2].float(), rope[..., 1::2].float()
        cos, sin = cos.float(), sin.float()
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
        return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
