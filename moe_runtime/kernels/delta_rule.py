"""The gated delta rule (Gated DeltaNet's recurrence), torch twins: chunked for prefill, one step for decode.

Per value head, with a state S [Dk, Dv] carried across tokens, token t with query q_t, key k_t (both
L2-normalised, q_t scaled by 1/sqrt(Dk)), value v_t, log-decay g_t <= 0 and write strength beta_t:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

Decoding runs that literally, one token for a batch of sequences (`delta_rule_step`). A prefill (or chunk)
of L tokens runs it `chunk` tokens at a time (`chunked_delta_rule`): inside a chunk the L sequential updates
are one lower-unitriangular solve (the corrections u depend on each other only through earlier keys of the
chunk), and the state is touched once per chunk, so the work is a few matmuls per chunk instead of L
rank-one updates. Both compute in float32 whatever the inputs are, as the recurrence is sensitive to rounding
over long contexts; the state stays float32 between steps (moe_runtime/layers/state_cache.py).
"""
from __future__ import annotations

import torch

DEFAULT_CHUNK = 64   # fla's and transformers' chunk: each boundary crossed costs fp32 rounding through the state


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L new tokens: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv] (the state
    before the first token) -> (outputs [L, H, Dv] float32, the state after the last token [H, Dk, Dv] float32)."""
    out, s, _ = chunked_delta_rule_states(q, k, v, g, beta, state, (), chunk)
    return out, s


def chunked_delta_rule_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor, offsets: tuple[int, ...] | list[int],
                              chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`chunked_delta_rule`, plus the state after each of the first `offsets` tokens (0 < offset <= L), for
    prefix-caching snapshots. The outputs and final state are the plain run's, bit for bit: a state inside a
    chunk is the final state of that chunk's leading part from the chunk's start state (one extra partial
    chunk per offset, never more than `chunk` tokens), the same math as a run stopping there."""
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))   # head first: [H, L, ...]
    s = state.float()
    length = q.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)              # [H, L, Dv]
    states: dict[int, torch.Tensor] = {}
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        for offset in offsets:
            if start < offset < stop:
                states[offset] = _one_chunk(q[:, start:offset], k[:, start:offset], v[:, start:offset],
                                            g[:, start:offset], beta[:, start:offset], s)[1]
        out[:, start:stop], s = _one_chunk(q[:, start:stop], k[:, start:stop], v[:, start:stop],
                                           g[:, start:stop], beta[:, start:stop], s)
        if stop in offsets:
            states[stop] = s
    return out.transpose(0, 1), s, [states[offset] for offset in offsets]


def _one_chunk(q, k, v, g, beta, s):  # [H, C, Dk], [H, C, Dk], [H, C, Dv], [H, C], [H, C], [H, Dk, Dv]
    """A chunk's outputs [H, C, Dv] and final state from its start state `s`.

    With G_i the decay accumulated from the chunk's start through token i, the corrections solve
    (I + A) u = beta v - beta exp(G) K s, A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i; then
    o_i = exp(G_i) s^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i.k_j) u_j and
    s' = exp(G_C) s + sum_j exp(G_C - G_j) k_j u_j^T."""
    size = q.shape[1]
    cum = g.cumsum(-1)                                                    # [H, C]
    later = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(later, float("-inf")).exp()   # [H, C, C], j <= i
    kk = k @ k.transpose(-1, -2)                                          # [H, C, C]
    system = torch.tril(beta[:, :, None] * kk * decay, -1) + torch.eye(size, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - cum.exp()[:, :, None] * (k @ s))       # [H, C, Dv]
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)   # [H, C, Dv]
    scores = (q @ k.transpose(-1, -2)) * decay                            # [H, C, C], zero above the diagonal
    out = cum.exp()[:, :, None] * (q @ s) + scores @ u                    # [H, C, Dv]
    to_end = (cum[:, -1:] - cum).exp()                                    # [H, C]
    s = cum[:, -1].exp()[:, None, None] * s + (k * to_end[:, :, None]).transpose(-1, -2) @ u
    return out, s


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv]
    -> (outputs [B, H, Dv] float32, new states [B, H, Dk, Dv] float32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float() * g.exp()[:, :, None, None]
    u = beta[:, :, None] * (v - torch.einsum("bhkv,bhk->bhv", s, k))      # [B, H, Dv]
    s = s + k[:, :, :, None] * u[:, :, None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s
