"""Pieces several model files share: rotary embedding and GQA attention from an HF config."""
from __future__ import annotations

import torch

from moe_runtime.layers.attention import Attention, AttentionShape
from moe_runtime.layers.partial_rotary import PartialRotaryEmbedding
from moe_runtime.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from moe_runtime.models.decoder import BuildContext


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_window_of(cfg, layer_index: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


def rotary_for(cfg, rotary_dim: int, device: torch.device, interleaved: bool = False) -> RotaryEmbedding:
    inv_freq, scaling = rope_inverse_frequencies(cfg, rotary_dim)   # computed on the host, as transformers does
    return RotaryEmbedding(inv_freq.to(device), scaling, interleaved)


def partial_rotary_for(cfg, rotary_dim: int, device: torch.device) -> PartialRotaryEmbedding:
    """Neox rotary over the first `rotary_dim` channels of each head (GLM-4.5, MiniMax-M2)."""
    inv_freq, scaling = rope_inverse_frequencies(cfg, rotary_dim)
    return PartialRotaryEmbedding(inv_freq.to(device), scaling, interleaved=False)


def gqa_attention(cfg, layer_index: int, ctx: BuildContext, *, qkv_bias: bool = False, o_bias: bool = False,
                  qk_norm: str | None = None, rotary_dim: int | None = None) -> Attention:
    """GQA attention of layer `layer_index`; `rotary_dim` below the head size rotates only those channels."""
    head_dim = head_dim_of(cfg)
    shape = AttentionShape(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        norm_eps=cfg.rms_norm_eps,
        clip_qkv=getattr(cfg, "clip_qkv", None),
        sliding_window=sliding_window_of(cfg, layer_index),
    )
    p = ctx.parallel
    partial = rotary_dim is not None and rotary_dim < head_dim
    rotary = partial_rotary_for(cfg, rotary_dim, ctx.device) if partial else rotary_for(cfg, head_dim, ctx.device)
    return Attention(shape, rotary, ctx.kernels, ctx.dtype, ctx.device,
                     p.attn_tp_size, p.attn_tp_rank, p.attn_tp_group, quant=ctx.linear_quant)
