"""Attention with soft-capped scores (Gemma 2: scores = cap * tanh(scores / cap) before the softmax) over the
paged cache, a loop over sequences in torch.

The paged decode and varlen prefill kernels take no cap, and a cap cannot be applied after them (it bends each
score before the softmax), so capped layers gather each sequence's keys from the cache and compute the scores
explicitly, in float32 as transformers' eager path does. The span (sliding window) and sinks are honoured the
same way as in attention_ops.varlen_causal_attention: keys before the first one a sequence's queries read are
dropped before any matmul (a windowed group's freed blocks hold anything)."""
from __future__ import annotations

import torch

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_span import AttentionSpan
from moe_runtime.layers.kv_cache import LayerKVCache


def softcapped_attention(
    q: torch.Tensor,                 # [T, Hq, D]
    batch: AttentionBatch,
    cache: LayerKVCache,
    scale: float,
    span: AttentionSpan,
    softcap: float,
    sinks: torch.Tensor | None = None,   # [Hq] fp32 sink logits
) -> torch.Tensor:                   # [T, Hq, Dv]
    outputs = []
    for seq in range(batch.num_seqs):
        start, length = batch.query_start[seq], batch.query_lens[seq]
        keys, values = cache.gather(batch.context_slots(seq))                        # [S, Hkv, D], [S, Hkv, Dv]
        total = keys.shape[0]
        first = span.first_needed(total - length)
        group = q.shape[1] // keys.shape[1]
        k = keys[first:].float().transpose(0, 1).repeat_interleave(group, dim=0)      # [Hq, S', D]
        v = values[first:].float().transpose(0, 1).repeat_interleave(group, dim=0)    # [Hq, S', Dv]
        scores = q[start : start + length].float().transpose(0, 1) @ k.transpose(1, 2) * scale   # [Hq, n, S']
        scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(total - length, total, device=q.device)[:, None]    # [n, 1]
        key_pos = torch.arange(first, total, device=q.device)[None, :]               # [1, S']
        scores = scores.masked_fill(~span.visible(query_pos, key_pos), float("-inf"))
        if sinks is not None:   # one more logit per head in every row's denominator, with no value
            sink = sinks.float().view(-1, 1, 1).expand(-1, length, 1)                # [Hq, n, 1]
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outputs.append((probs @ v).transpose(0, 1).to(q.dtype))                      # [n, Hq, Dv]
    if not outputs:
        return q.new_zeros(0, q.shape[1], cache.values.shape[-1])
    return torch.cat(outputs, dim=0)
