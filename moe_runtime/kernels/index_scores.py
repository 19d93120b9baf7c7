"""The lightning indexer's scores (DeepSeek Sparse Attention): for each query row and key,
sum_h weight_h * relu(scale * q_h . k), in fp32. The torch path, and the reference of the Triton kernel
(moe_runtime/kernels/triton_impl/index_scores.py). Keys are one context shared by every row ([S, D], a sequence's queries) or
each row's own ([n, S, D], a captured decode step's rows)."""
from __future__ import annotations

import torch


def check_index_inputs(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> None:
    rows, heads, dim = queries.shape
    if tuple(weights.shape) != (rows, heads) or keys.shape[-1] != dim or keys.dim() not in (2, 3) \
            or (keys.dim() == 3 and keys.shape[0] != rows):
        raise ValueError(f"queries [n, H, D], weights [n, H] and keys [S, D] or [n, S, D] expected, got "
                         f"{tuple(queries.shape)}, {tuple(weights.shape)}, {tuple(keys.shape)}")


def index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """queries [n, H, D], weights [n, H] fp32, keys [S, D] or [n, S, D] -> scores [n, S] fp32."""
    check_index_inputs(queries, weights, keys)
    pattern = "nhd,sd->nhs" if keys.dim() == 2 else "nhd,nsd->nhs"
    scores = torch.einsum(pattern, queries.float(), keys.float()) * scale                  # [n, H, S]
    return torch.einsum("nh,nhs->ns", weights.float(), scores.relu())
