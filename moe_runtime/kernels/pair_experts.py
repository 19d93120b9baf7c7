"""Routed experts as one GEMV per (token, expert) pair: the MoE kernel of a captured decode step.

The grouped kernels (`expert_mlp`, `masked_expert_mlp`) sort rows by expert and loop over busy
segments: data-dependent sizes that a graph compiler cannot capture. Here every one of the T*K
pairs multiplies its token's row by its expert's weights, written as gather-multiply-reduce
(`(w13[slot] * x[:, None, :]).sum(-1)`). Eager torch would materialize the gathered weights
([T*K, 2I, H]), so this form is only for `torch.compile`: inductor fuses the gather into the
reduction and emits one loop that streams each chosen expert's rows once per pair, widening
bf16/fp16 weights to fp32 in registers (no fp32 copy of the weights). On the 2-core AVX2 dev
machine that is 3-4x the grouped eager path at batch 1 and 1.6x at 16 rows (bench/bench_offline.py
--torch-compile). Pairs of one expert re-read its weights; at decode batch sizes they mostly hit
the cache. Accumulation is fp32, the weighted sum over K too, like the grouped path's combine.
Expert biases (gathered per pair like the weights) and the activation (`ExpertActivation`) are the
experts' own, as in the grouped kernels.
"""
from __future__ import annotations

import torch

from .expert_activation import ExpertActivation


def pair_expert_mlp(
    x: torch.Tensor,             # [T, H]
    slot_ids: torch.Tensor,      # [T, K] int64: the expert (local slot) of each pair
    weights: torch.Tensor,       # [T, K] float32 routing weights
    w13: torch.Tensor,           # [E, 2I, H]
    w2: torch.Tensor,            # [E, H, I]
    *,
    b13: torch.Tensor | None = None,   # [E, 2I]
    b2: torch.Tensor | None = None,    # [E, H]
    activation: ExpertActivation = ExpertActivation(),
) -> torch.Tensor:               # [T, H], weighted sum over each token's K experts
    num_tokens, top_k = slot_ids.shape
    pairs = slot_ids.reshape(-1)                                                   # [P]
    rows = x.float().repeat_interleave(top_k, dim=0)                               # [P, H]
    gate_up = (w13[pairs].float() * rows[:, None, :]).sum(-1)                      # [P, 2I]
    if b13 is not None:
        gate_up = gate_up + b13[pairs].float()
    activated = activation.on_gate_up(gate_up)                                     # [P, I]
    down = (w2[pairs].float() * activated[:, None, :]).sum(-1)                     # [P, H]
    if b2 is not None:
        down = down + b2[pairs].float()
    weighted = down.view(num_tokens, top_k, -1) * weights.float()[..., None]       # [T, K, H]
    return weighted.sum(1).to(x.dtype)                                             # [T, H]
