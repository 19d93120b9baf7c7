"""The gated delta rule token by token in float64: the oracle the chunked and one-step kernels are held to."""
from __future__ import annotations

import torch


def reference_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv] -> (outputs [L, H, Dv], final state),
    float64, one rank-one update per token (moe_runtime/kernels/delta_rule.py states the recurrence)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    s = state.double().clone()
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s[h] = s[h] * torch.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] = s[h] + torch.outer(k[t, h], u)
            out[t, h] = s[h].T @ q[t, h]
    return out, s
