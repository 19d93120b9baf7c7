"""Expert SwiGLU MLPs on the expert-grouped layouts (fast torch path: matmuls for busy experts only).

Optional expert biases (b13 [E, 2I] after the first projection, b2 [E, H] after the second: gpt-oss)
and the gated activation (`ExpertActivation`: silu, or gpt-oss's clamped SwiGLU) are the experts'
own properties, passed by keyword; the defaults are the plain bias-free SiLU MLP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .expert_activation import ExpertActivation, add_bias_
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


@dataclass(frozen=True)
class ExpertSegment:
    """The rows [start, end) of a contiguous expert-grouped layout that belong to `expert`."""

    expert: int
    start: int
    end: int


def check_expert_biases(w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
                        b2: torch.Tensor | None) -> None:
    """Validate the optional biases b13 [E, 2I] / b2 [E, H] against w13 [E, 2I, H] / w2 [E, H, I]."""
    if b13 is not None and tuple(b13.shape) != tuple(w13.shape[:2]):
        raise ValueError(f"b13 must be [E, 2I]={tuple(w13.shape[:2])}, got shape {tuple(b13.shape)}")
    if b2 is not None and tuple(b2.shape) != tuple(w2.shape[:2]):
        raise ValueError(f"b2 must be [E, H]={tuple(w2.shape[:2])}, got shape {tuple(b2.shape)}")


def check_sorted_counts(x_sorted: torch.Tensor, counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Validate counts [E] against x_sorted [N, H]; return the segments' ends (cumsum of counts) [E]."""
    if counts.shape != (num_experts,):
        raise ValueError(f"counts must be [E={num_experts}], got shape {tuple(counts.shape)}")
    if counts.numel() and int(counts.min()) < 0:   # a negative count would shift every later segment
        expert = int(torch.argmin(counts))
        raise ValueError(f"counts[{expert}]={int(counts[expert])} is negative")
    ends = torch.cumsum(counts, dim=0)                                     # [E]
    total = int(ends[-1]) if ends.numel() else 0
    if total != x_sorted.shape[0]:
        raise ValueError(f"counts sum to {total} but x_sorted has {x_sorted.shape[0]} rows")
    return ends


def check_masked_counts(x: torch.Tensor, counts: torch.Tensor, num_experts: int) -> int:
    """Validate the masked layout x [E, M, H] and counts [E]; return the largest count."""
    if x.dim() != 3 or x.shape[0] != num_experts:
        raise ValueError(f"x must be [E={num_experts}, M, H], got shape {tuple(x.shape)}")
    if counts.numel() and int(counts.min()) < 0:
        expert = int(torch.argmin(counts))
        raise ValueError(f"counts[{expert}]={int(counts[expert])} is negative")
    max_count = int(counts.max()) if counts.numel() else 0
    if max_count > x.shape[1]:
        expert = int(torch.argmax(counts))
        raise ValueError(f"counts[{expert}]={max_count} exceeds the masked layout's capacity M={x.shape[1]}")
    return max_count


def check_masked_layout(x: torch.Tensor, counts: torch.Tensor, num_experts: int) -> None:
    """Validate the shapes of the masked layout x [E, M, H] and counts [E]; the counts' values stay on the device."""
    if x.dim() != 3 or x.shape[0] != num_experts:
        raise ValueError(f"x must be [E={num_experts}, M, H], got shape {tuple(x.shape)}")
    if counts.shape != (num_experts,):
        raise ValueError(f"counts must be [E={num_experts}], got shape {tuple(counts.shape)}")


def busy_segments(counts: torch.Tensor, ends: torch.Tensor) -> list[ExpertSegment]:
    """One segment per expert that received rows: idle experts cost nothing (no weight is touched)."""
    busy = torch.nonzero(counts).flatten()                                 # experts that received rows
    starts = (ends[busy] - counts[busy]).tolist()
    return [ExpertSegment(expert, start, end) for expert, start, end in zip(busy.tolist(), starts, ends[busy].tolist())]


def masked_segments(counts: torch.Tensor) -> list[ExpertSegment]:
    """Busy experts of the masked layout [E, M, H]: expert e's rows are x[e, 0:counts[e]]."""
    return busy_segments(counts, ends=counts)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up, gate the first half (the w13 row order)."""
    intermediate = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :intermediate]).mul_(gate_up[..., intermediate:])


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
           b2: torch.Tensor | None = None, activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    """w2 @ act(w13 @ x + b13) + b2 of one expert for rows x [n, H]; w13 [2I, H], w2 [H, I], b13 [2I],
    b2 [H] -> [n, H]."""
    activated = activation.on_gate_up(add_bias_(linear_rows(x, w13), b13))   # [n, I]
    return add_bias_(linear_rows(activated, w2), b2)


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: ExpertActivation = ExpertActivation()) -> None:
    """out[n, H] = one expert's MLP (`swiglu`) on x [n, H]."""
    out.copy_(swiglu(x, w13, w2, b13, b2, activation))


def swiglu_padded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    """All experts at once on the masked layout: x [E, M, H] -> [E, M, H].

    Rows past an expert's count are computed too; callers drop them.
    """
    gate_up = batched_linear_rows(x, w13)                                  # [E, M, 2I]
    if b13 is not None:
        gate_up.add_(b13.to(gate_up.dtype).unsqueeze(1))
    down = batched_linear_rows(activation.on_gate_up(gate_up), w2)         # [E, M, H]
    if b2 is not None:
        down.add_(b2.to(down.dtype).unsqueeze(1))
    return down


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
    *,
    b13: torch.Tensor | None = None,   # [E, 2I]
    b2: torch.Tensor | None = None,    # [E, H]
    activation: ExpertActivation = ExpertActivation(),
) -> torch.Tensor:            # [N, H], unweighted
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    check_expert_biases(w13, w2, b13, b2)
    ends = check_sorted_counts(x_sorted, counts, w13.shape[0])             # [E]
    max_count = int(counts.max()) if counts.numel() else 0
    if padded_layout_wins(counts, max_count):
        return segments_through_padded(x_sorted, counts, ends, max_count,
                                       lambda padded: swiglu_padded(padded, w13, w2, b13, b2, activation))
    out = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    for seg in busy_segments(counts, ends):
        e = seg.expert
        swiglu_expert(x_sorted[seg.start:seg.end], w13[e], w2[e], out[seg.start:seg.end],
                      None if b13 is None else b13[e], None if b2 is None else b2[e], activation)
    return out


AllExperts = Callable[[torch.Tensor], torch.Tensor]   # [E, M, H] -> [E, M, H]: every expert on its own rows


def segments_through_padded(x_sorted: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor, max_count: int,
                            all_experts: AllExperts) -> torch.Tensor:   # [N, H] -> [N, H]
    """Contiguous segments -> masked [E, M, H] layout -> `all_experts` (batched) -> back to segments."""
    num_experts = counts.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), counts)  # [N]
    slot_of_row = torch.arange(x_sorted.shape[0], device=counts.device) - (ends - counts)[expert_of_row]  # [N]
    padded = x_sorted.new_zeros(num_experts, max_count, x_sorted.shape[1])  # [E, M, H]
    padded[expert_of_row, slot_of_row] = x_sorted
    return all_experts(padded)[expert_of_row, slot_of_row]                # [N, H]


def masked_through_padded(out: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, max_count: int,
                          all_experts: AllExperts) -> None:
    """out[:, :max_count] = `all_experts` on x's first max_count rows, zero past each expert's count (the stale
    rows there may hold NaN, which must not leak)."""
    valid = torch.arange(max_count, device=x.device) < counts.unsqueeze(1)  # [E, M']
    computed = all_experts(x[:, :max_count])                                # [E, M', H]
    out[:, :max_count] = torch.where(valid.unsqueeze(-1), computed, 0.0)


def masked_expert_mlp(
    x: torch.Tensor,          # [E, M, H]: expert e's first counts[e] rows are valid
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H]
    w2: torch.Tensor,         # [E, H, I]
    *,
    b13: torch.Tensor | None = None,   # [E, 2I]
    b2: torch.Tensor | None = None,    # [E, H]
    activation: ExpertActivation = ExpertActivation(),
) -> torch.Tensor:            # [E, M, H], rows past counts[e] are zero
    """The masked layout at its fixed capacity, as DeepEP's low-latency API is meant to be used: every expert
    computes all M rows (two batched matmuls) and the rows past its count are zeroed on the device. Nothing
    is read back: no segment sizes, no busiest count. It is the decode path of a low-latency dispatcher, whose
    M (max_tokens_per_rank x ranks) is small; the rows past a count may hold NaN, which `where` drops."""
    check_expert_weights(x.shape[-1], w13, w2)
    check_expert_biases(w13, w2, b13, b2)
    check_masked_layout(x, counts, w13.shape[0])
    valid = torch.arange(x.shape[1], device=x.device) < counts.unsqueeze(1)           # [E, M]
    return torch.where(valid.unsqueeze(-1), swiglu_padded(x, w13, w2, b13, b2, activation), 0.0)  # [E, M, H]
