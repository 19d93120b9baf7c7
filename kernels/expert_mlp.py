"""Expert SwiGLU MLPs on the expert-grouped layouts (fast torch path: matmuls for busy experts only)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def check_expert_weights(hidden: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Validate `w13 [E, 2I, H]` / `w2 [E, H, I]` against the hidden size; return I."""
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2*I, H={hidden}], got shape {tuple(w13.shape)}")
    intermediate = w13.shape[1] // 2
    if w2.shape != (w13.shape[0], hidden, intermediate):
        raise ValueError(f"w2 must be [E={w13.shape[0]}, H={hidden}, I={intermediate}], got shape {tuple(w2.shape)}")
    return intermediate


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, H] = w2 @ (silu(gate) * up) for one expert; w13 [2I, H], w2 [H, I]."""
    intermediate = w13.shape[0] // 2
    gate_up = torch.mm(x, w13.t())                                         # [n, 2I]
    activated = F.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])  # [n, I]
    torch.mm(activated, w2.t(), out=out)


def expert_mlp(
    x_sorted: torch.Tensor,   # [N, H] rows grouped by expert in contiguous segments
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H]
    w2: torch.Tensor,         # [E, H, I]
) -> torch.Tensor:            # [N, H], unweighted
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    if counts.shape != (w13.shape[0],):
        raise ValueError(f"counts must be [E={w13.shape[0]}], got shape {tuple(counts.shape)}")
    out = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    ends = torch.cumsum(counts, dim=0)                                     # [E]
    total = int(ends[-1]) if ends.numel() else 0
    if total != x_sorted.shape[0]:
        raise ValueError(f"counts sum to {total} but x_sorted has {x_sorted.shape[0]} rows")
    busy = torch.nonzero(counts).flatten()                                 # experts that received rows
    for expert, start, end in zip(busy.tolist(), (ends[busy] - counts[busy]).tolist(), ends[busy].tolist()):
        swiglu_expert(x_sorted[start:end], w13[expert], w2[expert], out[start:end])
    return out


def masked_expert_mlp(
    x: torch.Tensor,          # [E, M, H]: expert e's first counts[e] rows are valid
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H]
    w2: torch.Tensor,         # [E, H, I]
) -> torch.Tensor:            # [E, M, H], rows past counts[e] are zero
    check_expert_weights(x.shape[-1], w13, w2)
    if x.dim() != 3 or x.shape[0] != w13.shape[0]:
        raise ValueError(f"x must be [E={w13.shape[0]}, M, H], got shape {tuple(x.shape)}")
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[1], dtype=x.dtype, device=x.device)  # [E, M, H]
    busy = torch.nonzero(counts).flatten()                                 # experts that received rows
    for expert, count in zip(busy.tolist(), counts[busy].tolist()):
        if count > x.shape[1]:
            raise ValueError(f"counts[{expert}]={count} exceeds the masked layout's capacity M={x.shape[1]}")
        swiglu_expert(x[expert, :count], w13[expert], w2[expert], out[expert, :count])
    return out
