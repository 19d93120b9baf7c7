"""One key tile's work that the decode-style attention kernels share (the paged split-decode kernel, DeepSeek
Sparse Attention's kernel over chosen entries): a query block's scores against a tile of keys, one channel part
at a time (`head_dim_split`'s main and tail), and the tile's values folded into the running output."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def channel_scores(q, k_rows, key_ok, channels, FIRST: tl.constexpr, COUNT: tl.constexpr, USE_DOT: tl.constexpr,
                   PRECISION: tl.constexpr):
    """q [H, C] (channels FIRST .. FIRST + COUNT of each query, padded to C) against the keys at row pointers
    k_rows [N] (key_ok [N] masks) -> unscaled scores [H, N] fp32."""
    k = tl.load(k_rows[:, None] + FIRST + channels[None, :], mask=key_ok[:, None] & (channels[None, :] < COUNT),
                other=0.0)                                                                              # [N, C]
    if USE_DOT:
        scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION)
    else:
        scores = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    return scores


@triton.jit
def fold_values(acc, probs, correction, v_rows, key_ok, v_dims, V_DIM: tl.constexpr, USE_DOT: tl.constexpr,
                PRECISION: tl.constexpr):
    """acc [H, Dv] rescaled by correction [H] plus probs [H, N] times the values at row pointers v_rows [N]."""
    v = tl.load(v_rows[:, None] + v_dims[None, :], mask=key_ok[:, None] & (v_dims[None, :] < V_DIM),
                other=0.0)                                                                              # [N, Dv]
    if USE_DOT:
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    else:
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    return acc
