"""Causal attention of a chunk of queries over its cached prefix and itself, as two exact softmaxes merged by
their log-sum-exp.

Queries at positions [p, p + n) of a sequence attend to keys [0, p + n): all of the prefix [0, p) and,
causally, the chunk's own keys. One SDPA call with an explicit [n, p + n] mask computes every score of the
chunk's upper triangle and, on CPU, cannot use the flash kernel's causal block skipping. Split instead:

    (out_prefix, lse_prefix) = attention(q, keys[:p])            no mask: every prefix key is visible
    (out_chunk,  lse_chunk)  = attention(q, keys[p:], causal)    square: the flash kernel's causal path
    lse = logaddexp(lse_prefix, lse_chunk)
    out = out_prefix * exp(lse_prefix - lse) + out_chunk * exp(lse_chunk - lse)

which is the same softmax over the union of the keys (each part normalised by its own sum, reweighted by its
share of the total). This is the merge ring attention uses between passes; here it serves chunked prefill
and context-parallel pieces (a late piece of a long prompt is a chunk with a long prefix). On CPU the
flash kernel returns the log-sum-exp (`_scaled_dot_product_flash_attention_for_cpu`); elsewhere the
masked SDPA call is used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets from each set's result: out [B, H, n, Dv]
    and log-sum-exp of the scaled scores [B, H, n] (fp32)."""
    lse = torch.logaddexp(lse_a, lse_b)                                           # [B, H, n]
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


def flash_with_lse_available(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def prefix_causal_attention(
    q: torch.Tensor,      # [1, Hq, n, D]
    k: torch.Tensor,      # [1, Hkv, p + n, D]
    v: torch.Tensor,      # [1, Hkv, p + n, Dv]
    scale: float,
) -> torch.Tensor:        # [1, Hq, n, Dv]
    """Queries at positions [p, p + n) attending causally to keys [0, p + n), p = keys - queries >= 0."""
    n, total = q.shape[2], k.shape[2]
    prefix = total - n
    gqa = q.shape[1] != k.shape[1]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if not flash_with_lse_available(q):
        allowed = torch.arange(total, device=q.device)[None, :] <= torch.arange(prefix, total, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    value_dim = v.shape[3]
    width = max(q.shape[3], value_dim)   # the kernel wants one head size: zero columns change no score or output
    q, k, v = (F.pad(t, (0, width - t.shape[3])) if t.shape[3] < width else t for t in (q, k, v))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_prefix, lse_prefix = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)[:2]
    out_chunk, lse_chunk = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)[:2]
    return merge_attention_states(out_prefix, lse_prefix, out_chunk, lse_chunk)[..., :value_dim]
