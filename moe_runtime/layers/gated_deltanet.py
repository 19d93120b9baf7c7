"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5-MoE (three of every four layers).

Per token: projections give q, k (num_k_heads x Dk), v and the output gate z (num_v_heads x Dv), and per value
head a write strength b and a decay input a; q, k, v go through a short causal convolution (SiLU); q and k are
L2-normalised (q also scaled by 1/sqrt(Dk)) and each k head serves num_v_heads / num_k_heads consecutive value
heads; beta = sigmoid(b), log decay g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
(moe_runtime/kernels/delta_rule.py) gives one output per value head, normalised per head and gated by silu(z)
(`GatedRMSNorm`), then projected back.

Checkpoint layouts: Qwen3-Next fuses the projections per key head (`in_proj_qkvz` rows [k head j: q_j, k_j, v
and z of its value heads], `in_proj_ba` likewise); Qwen3.5-MoE keeps them apart (`in_proj_qkv` as [q all heads,
k all heads, v all heads], `in_proj_z`, `in_proj_b`, `in_proj_a`). The convolution's channels are ordered
[q, k, v] in both.

Under attention TP a rank holds whole key heads and their value heads (heads split, states split with them):
the projections are column parallel (`RowRangesLinear` reads its heads' rows of each part), `out_proj` row
parallel with one all-reduce, as in the full attention layers. The layer keeps its per-sequence states in the
step's state slots (`AttentionBatch.state_slots`, moe_runtime/layers/state_cache.py): decodes advance theirs
together in one step, prefills and chunks each continue from theirs and leave it at their last token.

Prefix caching snapshots (`LayerStateCache.captures`): the states after a block boundary's token, written during
the step that computes it. The convolution's is the K-1 inputs before the boundary (read off the step's inputs);
the delta rule's is computed beside the step's own (`chunked_delta_rule_states`: the boundary's chunk run up to
it from that chunk's start state, the math of a run ending there), leaving the step's outputs and final state bit
for bit what they are without snapshots. With fla on CUDA, whose kernel keeps its chunk states inside, the
snapshots come from a second run of the step's tokens up to the last boundary, from the same start state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_runtime.kernels.delta_rule import chunked_delta_rule, chunked_delta_rule_states, delta_rule_step
from moe_runtime.kernels.delta_rule_fla import fla_available, fla_chunked_delta_rule, fla_delta_rule_step
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.hybrid_norms import GatedRMSNorm
from moe_runtime.layers.linear import Linear, LinearShard
from moe_runtime.layers.row_ranges import RowRangesLinear, load_rows
from moe_runtime.layers.short_conv import ShortConv
from moe_runtime.layers.state_cache import LayerStateCache, StateSpec

L2_EPS = 1e-6   # fla's and transformers' epsilon inside the q/k L2 norm


@dataclass(frozen=True)
class DeltaNetShape:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    fused_projections: bool   # Qwen3-Next's in_proj_qkvz / in_proj_ba (else Qwen3.5's four projections)

    @classmethod
    def from_config(cls, cfg, fused_projections: bool) -> "DeltaNetShape":
        return cls(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, fused_projections)

    @property
    def heads_per_key(self) -> int:
        return self.num_v_heads // self.num_k_heads


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: DeltaNetShape, dtype=torch.float32, device=None, tp_size: int = 1, tp_rank: int = 0,
                 tp_group=None):
        super().__init__()
        s = self.shape = shape
        if s.num_k_heads % tp_size:
            raise ValueError(f"Gated DeltaNet with {s.num_k_heads} key heads cannot split over {tp_size} attention "
                             "TP ranks (each rank holds whole key heads)")
        self.tp_size, self.tp_group = tp_size, tp_group
        r, dk, dv = s.heads_per_key, s.head_k_dim, s.head_v_dim
        self.nk = s.num_k_heads // tp_size                     # local key heads
        self.nv = self.nk * r                                  # local value heads
        ks, ke = tp_rank * self.nk, (tp_rank + 1) * self.nk
        vs, ve = ks * r, ke * r
        key_dim = s.num_k_heads * dk
        qkv_rows = ((ks * dk, ke * dk), (key_dim + ks * dk, key_dim + ke * dk),
                    (2 * key_dim + vs * dv, 2 * key_dim + ve * dv))
        if s.fused_projections:
            width = 2 * dk + 2 * r * dv
            self.in_proj_qkvz = RowRangesLinear(s.hidden_size, ((ks * width, ke * width),), dtype, device)
            self.in_proj_ba = RowRangesLinear(s.hidden_size, ((ks * 2 * r, ke * 2 * r),), dtype, device)
        else:
            self.in_proj_qkv = RowRangesLinear(s.hidden_size, qkv_rows, dtype, device)
            self.in_proj_z = RowRangesLinear(s.hidden_size, ((vs * dv, ve * dv),), dtype, device)
            self.in_proj_b = RowRangesLinear(s.hidden_size, ((vs, ve),), dtype, device)
            self.in_proj_a = RowRangesLinear(s.hidden_size, ((vs, ve),), dtype, device)
        self.conv_rows = qkv_rows
        self.conv1d = ShortConv(2 * self.nk * dk + self.nv * dv, s.conv_kernel, dtype, device)
        self.head_rows = ((vs, ve),)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=dtype, device=device), requires_grad=False)
        self.norm = GatedRMSNorm(dv, s.norm_eps, dtype, device)
        out_cols = None if tp_size == 1 else LinearShard(1, vs * dv, ve * dv)
        self.out_proj = Linear(self.nv * dv, s.hidden_size, False, dtype, device, out_cols)
        self._use_fla = fla_available(torch.device(device if device is not None else "cpu"))

    def load_weights(self, reader, prefix: str) -> set[str]:
        """This rank's heads of the convolution and of the per-head decay parameters (the projections load
        themselves)."""
        load_rows(self.conv1d.weight, reader, f"{prefix}conv1d.weight", self.conv_rows)
        load_rows(self.dt_bias, reader, f"{prefix}dt_bias", self.head_rows)
        load_rows(self.A_log, reader, f"{prefix}A_log", self.head_rows)
        return {"conv1d.weight", "dt_bias", "A_log"}

    def state_spec(self) -> StateSpec:
        s = self.shape
        return StateSpec(self.conv1d.weight.shape[0], s.conv_kernel - 1, self.nv, s.head_k_dim, s.head_v_dim)

    def _project(self, x: torch.Tensor):  # [T, H] -> mixed [T, C], z [T, nv, dv], b [T, nv], a [T, nv]
        s, t = self.shape, x.shape[0]
        r, dk, dv = s.heads_per_key, s.head_k_dim, s.head_v_dim
        if not s.fused_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.nv, dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        qkvz = self.in_proj_qkvz(x).view(t, self.nk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, self.nk * dk), k.reshape(t, self.nk * dk), v.reshape(t, self.nv * dv)], -1)
        return mixed, z.reshape(t, self.nv, dv), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: AttentionBatch,
                cache: LayerStateCache) -> torch.Tensor:  # [T, H] -> [T, H]
        s, t = self.shape, x.shape[0]
        dk, dv = s.head_k_dim, s.head_v_dim
        slots = batch.state_slots or []
        mixed, z, b, a = self._project(x)
        if cache.captures:
            _snapshot_conv(mixed, batch.query_start, slots, cache)
        mixed = self.conv1d(mixed, batch.query_start, slots, cache.conv)
        q, k, v = mixed.split([self.nk * dk, self.nk * dk, self.nv * dv], dim=-1)
        q = _l2(q.view(t, self.nk, dk))
        k = _l2(k.view(t, self.nk, dk))
        q = (q * dk ** -0.5).repeat_interleave(s.heads_per_key, dim=1)       # [T, nv, dk]
        k = k.repeat_interleave(s.heads_per_key, dim=1)
        v = v.view(t, self.nv, dv)
        beta = b.float().sigmoid()                                             # [T, nv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core = self._delta_rule(q, k, v, g, beta, batch.query_start, slots, cache.ssm,
                                cache.captures).to(x.dtype)  # [T, nv, dv]
        out = self.out_proj(self.norm(core, z).reshape(t, self.nv * dv))
        return self.out_proj.reduce(out, self.tp_group) if self.tp_size > 1 else out

    def _delta_rule(self, q, k, v, g, beta, query_start: list[int], slots: list[int], ssm: torch.Tensor,
                    captures: dict[int, list[tuple[int, int]]]) -> torch.Tensor:  # -> [T, nv, dv] float32
        """Decodes advance their states together; each prefill or chunk runs chunked from its own state, and its
        snapshot rows get the states after their boundaries' tokens."""
        chunked, step = ((fla_chunked_delta_rule, fla_delta_rule_step) if self._use_fla
                         else (chunked_delta_rule, delta_rule_step))
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        single = [i for i in range(len(slots)) if query_start[i + 1] - query_start[i] == 1]
        if single:
            rows = torch.tensor([query_start[i] for i in single], device=v.device)
            index = torch.tensor([slots[i] for i in single], device=v.device)
            out[rows], ssm[index] = step(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm[index])
            for i in single:
                for _, row in captures.get(slots[i], ()):
                    ssm[row] = ssm[slots[i]]
        for i, slot in enumerate(slots):
            start, stop = query_start[i], query_start[i + 1]
            if stop - start <= 1:
                continue
            cuts = captures.get(slot, [])
            if not cuts:
                out[start:stop], ssm[slot] = chunked(q[start:stop], k[start:stop], v[start:stop], g[start:stop],
                                                     beta[start:stop], ssm[slot])
                continue
            offsets = [offset for offset, _ in cuts]
            if self._use_fla:
                states = _fla_states_at(q[start:stop], k[start:stop], v[start:stop], g[start:stop],
                                        beta[start:stop], ssm[slot], offsets)
                out[start:stop], ssm[slot] = chunked(q[start:stop], k[start:stop], v[start:stop], g[start:stop],
                                                     beta[start:stop], ssm[slot])
            else:
                out[start:stop], ssm[slot], states = chunked_delta_rule_states(
                    q[start:stop], k[start:stop], v[start:stop], g[start:stop], beta[start:stop], ssm[slot], offsets)
            for (_, row), state in zip(cuts, states):
                ssm[row] = state
        return out


def _fla_states_at(q, k, v, g, beta, state, offsets: list[int]) -> list[torch.Tensor]:
    """The states after each of the first `offsets` tokens (a snapshot and a draft checkpoint may share one),
    by fla runs from one boundary to the next."""
    states, previous = [], 0
    for offset in sorted(set(offsets)):
        _, state = fla_chunked_delta_rule(q[previous:offset], k[previous:offset], v[previous:offset],
                                          g[previous:offset], beta[previous:offset], state)
        states.append(state)
        previous = offset
    by_offset = dict(zip(sorted(set(offsets)), states))
    return [by_offset[offset] for offset in offsets]


def _snapshot_conv(mixed: torch.Tensor, query_start: list[int], slots: list[int],
                   cache: LayerStateCache) -> None:  # mixed [T, C], before the convolution updates the slots
    """The convolution's state at each snapshot boundary: the K-1 inputs before it (the slot's kept ones, then
    this step's)."""
    width = cache.conv.shape[-1]
    for b, slot in enumerate(slots):
        for offset, row in cache.captures.get(slot, ()):
            start = query_start[b]
            inputs = torch.cat([cache.conv[slot], mixed[start:start + offset].T.to(cache.conv.dtype)], dim=-1)
            cache.conv[row] = inputs[:, inputs.shape[1] - width:]


def _l2(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D] fp32
    """x / sqrt(sum x^2 + eps) in fp32 (fla's and transformers' form of the q/k L2 norm)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + L2_EPS)
