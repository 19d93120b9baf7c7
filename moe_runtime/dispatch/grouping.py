"""Grouping received rows by local expert, and the weighted reduction that undoes it.

Every contiguous-layout backend ends up with "rows" on this rank (its own tokens, gathered tokens
or received tokens) and, per row, up to K local experts with routing weights. Dispatch expands
them to one row per (row, local expert) pair, grouped by expert; combine folds expert outputs
back to one weighted partial sum per row.
"""

from __future__ import annotations

import dataclasses

import torch


REDUCE_CHUNK_ELEMENTS = 1 << 20  # elements of the weighted temporary per reduction chunk


@dataclasses.dataclass
class ExpertGrouping:
    row_index: torch.Tensor                # [N] int64: source row of each grouped entry
    weight: torch.Tensor                   # [N] float32: routing weight of each grouped entry
    tokens_per_local_expert: torch.Tensor  # [E_local] int64
    num_rows: int                          # number of rows row_index points into


def group_by_local_expert(local_expert: torch.Tensor, weights: torch.Tensor,
                          num_local_experts: int) -> ExpertGrouping:
    """local_expert [R, K] (-1 = not on this rank), weights [R, K] -> grouping, stable in row."""
    valid = local_expert >= 0                                   # [R, K]
    rows, ks = valid.nonzero(as_tuple=True)                     # [N], row-major order
    experts = local_expert[rows, ks]                            # [N]
    order = torch.sort(experts, stable=True).indices            # group by expert, keep row order
    return ExpertGrouping(
        row_index=rows[order],
        weight=weights[rows, ks][order].to(torch.float32),
        tokens_per_local_expert=torch.bincount(experts, minlength=num_local_experts).to(torch.int64),
        num_rows=local_expert.shape[0],
    )


def gather_grouped(rows: torch.Tensor, grouping: ExpertGrouping) -> torch.Tensor:
    """rows [R, H] -> recv_x [N, H] grouped by local expert."""
    return rows.index_select(0, grouping.row_index)


def reduce_grouped(expert_out: torch.Tensor, grouping: ExpertGrouping,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """expert_out [N, H] unweighted -> [R, H] weighted sums per row (accumulated in fp32)."""
    if expert_out.dim() != 2 or expert_out.shape[0] != grouping.row_index.shape[0]:
        raise ValueError(f"combine: expert_out must be [{grouping.row_index.shape[0]}, H] like "
                         f"recv_x, got shape {tuple(expert_out.shape)}")
    acc_dtype = torch.promote_types(expert_out.dtype, torch.float32)
    acc = torch.zeros(grouping.num_rows, expert_out.shape[1], dtype=acc_dtype,
                      device=expert_out.device)
    weight = grouping.weight.to(acc_dtype).unsqueeze(1)                    # [N, 1]
    # Chunks keep the weighted fp32 temporary small (cache-resident, no page faults): on CPU this
    # is ~4x faster than weighting all N rows at once.
    chunk = max(1, REDUCE_CHUNK_ELEMENTS // max(1, expert_out.shape[1]))
    for start in range(0, expert_out.shape[0], chunk):
        end = start + chunk
        weighted = expert_out[start:end].to(acc_dtype) * weight[start:end]
        acc.index_add_(0, grouping.row_index[start:end], weighted)
    return acc.to(out_dtype)
