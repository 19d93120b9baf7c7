"""Attention of each query row over its own chosen cache entries (DeepSeek Sparse Attention's MLA, absorbed): the
torch path, and the reference the Triton kernel (moe_runtime/kernels/triton_impl/sparse_latent_attention.py) is held to.

Row t attends to the entries at flat slots `slots[t]` (-1: none there; a row's chosen tokens padded to the step's
widest choice). An entry is [latent | rotated key]: the whole entry is the key, its first `value_dim` channels
the value (MLA's latent is both). Rows run in slabs whose gathered entries stay bounded.
"""
from __future__ import annotations

import torch

SLAB_ELEMENTS = 1 << 24   # the most gathered-entry and score values one slab of rows materialises


def slab_rows(elements_per_row: int) -> int:
    """Rows per slab when each row materialises `elements_per_row` values: within SLAB_ELEMENTS."""
    return max(SLAB_ELEMENTS // max(elements_per_row, 1), 1)


def check_sparse_inputs(q: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor, value_dim: int) -> None:
    if q.dim() != 3 or entries.dim() != 2 or slots.dim() != 2:
        raise ValueError(f"q [T, H, D], entries [N, D], slots [T, K] expected, got {tuple(q.shape)}, "
                         f"{tuple(entries.shape)}, {tuple(slots.shape)}")
    if q.shape[2] != entries.shape[1] or slots.shape[0] != q.shape[0] or not 0 < value_dim <= entries.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, entries {tuple(entries.shape)}, slots {tuple(slots.shape)} and "
                         f"value_dim {value_dim} do not fit together")


def sparse_latent_attention(q: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor, scale: float,
                            value_dim: int) -> torch.Tensor:
    """q [T, H, D], entries [N, D], slots [T, K] int64 -> [T, H, value_dim] (fp32 scores and softmax; a row
    with no entry gets zeros)."""
    check_sparse_inputs(q, entries, slots, value_dim)
    rows, heads, dim = q.shape
    width = slots.shape[1]
    out = q.new_zeros(rows, heads, value_dim)
    step = slab_rows(width * (dim + heads))
    for first in range(0, rows, step):
        chosen = slots[first:first + step]                                                  # [n, K]
        valid = chosen >= 0
        picked = entries.index_select(0, chosen.clamp(min=0).reshape(-1)).view(*chosen.shape, dim).float()
        logits = torch.einsum("nhd,nkd->nhk", q[first:first + step].float(), picked) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)                               # [n, H, K]
        out[first:first + step] = torch.einsum("nhk,nkv->nhv", probs, picked[..., :value_dim]).to(out.dtype)
    return out
