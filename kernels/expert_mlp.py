"""Expert SwiGLU MLPs on the expert-grouped layouts (fast torch path: matmuls for busy experts only)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .skinny_matmul import SKINNY_ROWS_MAX, batched_linear_rows, linear_rows

# Padding every expert to the busiest one's row count and running two batched matmuls reads every
# expert's weights once with no Python loop; it wins when most experts are busy and counts are small.
PADDED_BUSY_FRACTION_MIN = 0.5


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
    gate_up = linear_rows(x, w13)                                          # [n, 2I]
    activated = F.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])  # [n, I]
    out.copy_(linear_rows(activated, w2))


def swiglu_padded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """All experts at once on the masked layout: x [E, M, H] -> [E, M, H].

    Rows past an expert's count are computed too; callers drop them.
    """
    intermediate = w13.shape[1] // 2
    gate_up = batched_linear_rows(x, w13)                                  # [E, M, 2I]
    activated = F.silu(gate_up[..., :intermediate]).mul_(gate_up[..., intermediate:])  # [E, M, I]
    return batched_linear_rows(activated, w2)                              # [E, M, H]


def padded_layout_wins(counts: torch.Tensor, max_count: int) -> bool:
    """Decode-sized segments on most experts: the batched all-experts form beats a loop over busy ones."""
    if counts.device.type != "cpu" or not 0 < max_count <= SKINNY_ROWS_MAX:
        return False
    busy = int(torch.count_nonzero(counts))
    return busy >= PADDED_BUSY_FRACTION_MIN * counts.shape[0]


def expert_mlp(
    x_sorted: torch.Tensor,   # [N, H] rows grouped by expert in contiguous segments
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H]
    w2: torch.Tensor,         # [E, H, I]
) -> torch.Tensor:            # [N, H], unweighted
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    if counts.shape != (w13.shape[0],):
        raise ValueError(f"counts must be [E={w13.shape[0]}], got shape {tuple(counts.shape)}")
    ends = torch.cumsum(counts, dim=0)                                     # [E]
    total = int(ends[-1]) if ends.numel() else 0
    if total != x_sorted.shape[0]:
        raise ValueError(f"counts sum to {total} but x_sorted has {x_sorted.shape[0]} rows")
    max_count = int(counts.max()) if counts.numel() else 0
    if padded_layout_wins(counts, max_count):
        return _expert_mlp_padded(x_sorted, counts, ends, w13, w2, max_count)
    out = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    busy = torch.nonzero(counts).flatten()                                 # experts that received rows
    for expert, start, end in zip(busy.tolist(), (ends[busy] - counts[busy]).tolist(), ends[busy].tolist()):
        swiglu_expert(x_sorted[start:end], w13[expert], w2[expert], out[start:end])
    return out


def _expert_mlp_padded(x_sorted, counts, ends, w13, w2, max_count: int) -> torch.Tensor:
    """Contiguous segments -> masked [E, M, H] layout -> batched experts -> back to segments."""
    num_experts = counts.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), counts)  # [N]
    slot_of_row = torch.arange(x_sorted.shape[0], device=counts.device) - (ends - counts)[expert_of_row]  # [N]
    padded = x_sorted.new_zeros(num_experts, max_count, x_sorted.shape[1])  # [E, M, H]
    padded[expert_of_row, slot_of_row] = x_sorted
    return swiglu_padded(padded, w13, w2)[expert_of_row, slot_of_row]     # [N, H]


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
    max_count = int(counts.max()) if counts.numel() else 0
    if max_count > x.shape[1]:
        expert = int(torch.argmax(counts))
        raise ValueError(f"counts[{expert}]={max_count} exceeds the masked layout's capacity M={x.shape[1]}")
    if padded_layout_wins(counts, max_count):
        valid = torch.arange(max_count, device=x.device) < counts.unsqueeze(1)  # [E, M']
        computed = swiglu_padded(x[:, :max_count], w13, w2)                # [E, M', H]
        out[:, :max_count] = torch.where(valid.unsqueeze(-1), computed, 0.0)  # stale rows may hold NaN
        return out
    busy = torch.nonzero(counts).flatten()                                 # experts that received rows
    for expert, count in zip(busy.tolist(), counts[busy].tolist()):
        swiglu_expert(x[expert, :count], w13[expert], w2[expert], out[expert, :count])
    return out
