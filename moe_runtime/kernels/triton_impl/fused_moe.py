"""Single-rank fused MoE: align -> grouped SwiGLU GEMM (gathering tokens) -> down GEMM -> reduce."""
from __future__ import annotations

import torch

from ..expert_mlp import check_expert_weights
from .align import align_block_size
from .grouped_gemm import pick_block_m, swiglu_then_down
from .unpermute import reduce_pairs


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, **epilogue) -> torch.Tensor:
    """`epilogue`: the experts' b13 [E, 2I], b2 [E, H] and activation_kind (grouped_gemm.swiglu_then_down)."""
    check_expert_weights(x.shape[-1], w13, w2)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={x.shape[0]}, K]"
        )
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    aligned = align_block_size(topk_ids, num_experts, pick_block_m(num_tokens * top_k, num_experts))
    x = x.contiguous()
    out_padded = torch.empty(aligned.schedule.padded_rows.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    # Padded rows hold flat (token, k) indices: token = flat // K.
    swiglu_then_down(x, aligned.schedule, w13, w2, out_padded, gather_a=True, scatter_out=False,
                     a_row_divisor=max(top_k, 1), **epilogue)
    return reduce_pairs(out_padded, aligned.padded_slot, topk_weights, num_tokens)
