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

`span_causal_attention` adds what the late-2026 models need on top: a span (sliding window or chunk; keys
no query of the chunk reads are cut off before any matmul) and attention sinks (gpt-oss: one learned logit
per head in every row's softmax denominator, `with_sinks`), both from the same log-sum-exps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .key_span import KeySpan, is_windowed


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


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax denominator also holds one logit per head and no value (gpt-oss's sinks;
    transformers concatenates it to the scores, softmaxes and drops its column): each row's output over its
    keys, out [B, H, n, Dv] with log-sum-exp [B, H, n], scaled by the keys' share of the enlarged denominator,
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink) (0 for a row with no key)."""
    share = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))                # [B, H, n]
    return (out.float() * share.unsqueeze(-1)).to(out.dtype)


def _flash_with_lse(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """The CPU flash kernel's (out [1, Hq, n, Dv], lse [1, Hq, n] fp32); `mask` [n, S] bool (True: visible)."""
    value_dim = v.shape[3]
    width = max(q.shape[3], value_dim)   # the kernel wants one head size: zero columns change no score or output
    q, k, v = (F.pad(t, (0, width - t.shape[3])) if t.shape[3] < width else t for t in (q, k, v))
    additive = None
    if mask is not None:                 # the kernel takes an additive mask of the queries' dtype
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)[:2]
    return out[..., :value_dim], lse


def masked_attention_with_lse(q, k, v, allowed: torch.Tensor, scale: float):
    """(out [1, Hq, n, Dv], lse [1, Hq, n] fp32) of queries over keys where `allowed` [n, S]: the CPU flash
    kernel there, explicit fp32 math elsewhere (the torch family off CPU; no fused kernel returns the lse)."""
    if flash_with_lse_available(q):
        return _flash_with_lse(q, k, v, scale, False, allowed)
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)                                  # [1, Hq, S, D]
    values = v.float().repeat_interleave(group, dim=1)                                # [1, Hq, S, Dv]
    scores = (q.float() @ keys.transpose(2, 3)).mul_(scale).masked_fill_(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                             # [1, Hq, n]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)                    # a row with no key: 0
    return (probs @ values).to(q.dtype), lse


def prefix_causal_attention_with_lse(q, k, v, scale: float):
    """`prefix_causal_attention`'s result and its log-sum-exp [1, Hq, n] (what sinks are merged with)."""
    n, total = q.shape[2], k.shape[2]
    prefix = total - n
    if not flash_with_lse_available(q):
        allowed = torch.arange(total, device=q.device)[None, :] <= torch.arange(prefix, total, device=q.device)[:, None]
        return masked_attention_with_lse(q, k, v, allowed, scale)
    if prefix == 0:
        return _flash_with_lse(q, k, v, scale, True)
    out_prefix, lse_prefix = _flash_with_lse(q, k[:, :, :prefix], v[:, :, :prefix], scale, False)
    out_chunk, lse_chunk = _flash_with_lse(q, k[:, :, prefix:], v[:, :, prefix:], scale, True)
    return merge_attention_states(out_prefix, lse_prefix, out_chunk, lse_chunk), torch.logaddexp(lse_prefix, lse_chunk)


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
    return prefix_causal_attention_with_lse(q, k, v, scale)[0]


def span_causal_attention(
    q: torch.Tensor,      # [1, Hq, n, D]
    k: torch.Tensor,      # [1, Hkv, S, D]: keys at positions [offset, offset + S), the last n the queries'
    v: torch.Tensor,      # [1, Hkv, S, Dv]
    scale: float,
    span: KeySpan | None = None,
    sinks: torch.Tensor | None = None,   # [Hq] fp32 logits, or None
    offset: int = 0,      # position of the first key given (a caller may gather only from the first one read)
) -> torch.Tensor:        # [1, Hq, n, Dv]
    """`prefix_causal_attention` under a span (a query at position i reads keys [span.first_needed(i), i]) and
    with sinks. Keys before the first query's first key are cut off first: no query reads them, and in a
    windowed KV cache group they may lie in freed blocks (the scratch block) holding anything."""
    n, total = q.shape[2], offset + k.shape[2]
    if not is_windowed(span):
        if offset:
            raise ValueError("full attention reads every key: a context gathered from a later position is cut short")
        if sinks is None:
            return prefix_causal_attention(q, k, v, scale)
        return with_sinks(*prefix_causal_attention_with_lse(q, k, v, scale), sinks)
    start = span.first_needed(total - n)
    if start < offset:
        raise ValueError(f"the queries read from position {start}, but the keys given start at {offset}")
    k, v = k[:, :, start - offset :], v[:, :, start - offset :]
    query_pos = torch.arange(total - n, total, device=q.device)[:, None]                  # [n, 1]
    key_pos = torch.arange(start, total, device=q.device)[None, :]                        # [1, S']
    allowed = span.visible(query_pos, key_pos)                                            # [n, S']
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return with_sinks(*masked_attention_with_lse(q, k, v, allowed, scale), sinks)
