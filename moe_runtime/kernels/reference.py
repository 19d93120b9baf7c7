"""Naive oracle implementations: every expert on every token, per-sequence attention loops.

Slow on purpose and written to be obviously right; the fast paths and Triton twins are tested
against these. Routing has no separate naive twin: `routing.select_experts` is itself held
against the transformers router modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .expert_activation import ExpertActivation
from .expert_mlp import check_expert_weights
from .fp8_block_weights import check_fp8_weight
from .int4_layout import Int4Layout, dequantize_int4
from .int8_weights import check_int8_weight
from .mxfp4_weights import E8M0_BIAS, MXFP4_BLOCK, check_mxfp4_weight, e2m1_table
from .permute import PermutePlan, offsets_from_counts
from .rms_norm import NormOutput


def all_experts_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13=None, b2=None,
                    activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    """[T, H] -> [E, T, H]: every expert applied to every row, in fp32 (biases b13 [E, 2I], b2 [E, H])."""
    intermediate = check_expert_weights(x.shape[-1], w13, w2)
    gate_up = torch.einsum("th,eih->eti", x.float(), w13.float())              # [E, T, 2I]
    if b13 is not None:
        gate_up = gate_up + b13.float()[:, None, :]
    activated = activation.apply(gate_up[..., :intermediate], gate_up[..., intermediate:])  # [E, T, I]
    out = torch.einsum("eti,ehi->eth", activated, w2.float())                 # [E, T, H]
    return out if b2 is None else out + b2.float()[:, None, :]


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int) -> PermutePlan:
    flat_ids = topk_ids.reshape(-1).tolist()
    top_k = max(topk_ids.shape[1], 1)
    rows = [(expert, flat) for flat, expert in enumerate(flat_ids) if 0 <= expert < num_experts]
    rows.sort(key=lambda row: row[0])                                         # Python sort is stable
    flat_index = torch.tensor([flat for _, flat in rows], dtype=torch.int64, device=topk_ids.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
    for expert, _ in rows:
        counts[expert] += 1
    return PermutePlan(flat_index // top_k, flat_index, counts, offsets_from_counts(counts))


def expert_mlp(x_sorted, counts, w13, w2, *, b13=None, b2=None,
               activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    expert_of_row = torch.repeat_interleave(torch.arange(w13.shape[0], device=counts.device), counts)  # [N]
    every = all_experts_mlp(x_sorted, w13, w2, b13, b2, activation)          # [E, N, H]
    rows = torch.arange(x_sorted.shape[0], device=x_sorted.device)
    return every[expert_of_row, rows].to(x_sorted.dtype)


def masked_expert_mlp(x, counts, w13, w2, *, b13=None, b2=None,
                      activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    out = torch.zeros(*x.shape[:2], w2.shape[1], dtype=x.dtype, device=x.device)  # [E, M, H]
    for expert in range(x.shape[0]):
        every = all_experts_mlp(x[expert], w13, w2, b13, b2, activation)     # [E, M, H]
        count = int(counts[expert])
        out[expert, :count] = every[expert, :count].to(x.dtype)
    return out


def dequantize_fp8(weight, scale, block_k: int) -> torch.Tensor:
    """The plain formula, all at once, in fp32: weight * scale repeated block_k times along K."""
    check_fp8_weight(weight, scale, block_k)
    return weight.float() * scale.repeat_interleave(block_k, -1)[..., :weight.shape[-1]]


def fp8_linear(x, weight, scale, block_k: int, bias=None) -> torch.Tensor:
    out = F.linear(x.float(), dequantize_fp8(weight, scale, block_k), None if bias is None else bias.float())
    return out.to(x.dtype)


def fp8_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale, block_k: int) -> torch.Tensor:
    return expert_mlp(x_sorted, counts, dequantize_fp8(w13, w13_scale, block_k), dequantize_fp8(w2, w2_scale, block_k))


def fp8_masked_expert_mlp(x, counts, w13, w13_scale, w2, w2_scale, block_k: int) -> torch.Tensor:
    return masked_expert_mlp(x, counts, dequantize_fp8(w13, w13_scale, block_k),
                             dequantize_fp8(w2, w2_scale, block_k))


def dequantize_int8(weight, scale) -> torch.Tensor:
    """The plain formula, all at once, in fp32: weight * its row's scale."""
    check_int8_weight(weight, scale)
    return weight.float() * scale.unsqueeze(-1)


def int8_linear(x, weight, scale, bias=None) -> torch.Tensor:
    out = F.linear(x.float(), dequantize_int8(weight, scale), None if bias is None else bias.float())
    return out.to(x.dtype)


def int8_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    return expert_mlp(x_sorted, counts, dequantize_int8(w13, w13_scale), dequantize_int8(w2, w2_scale))


def int8_masked_expert_mlp(x, counts, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    return masked_expert_mlp(x, counts, dequantize_int8(w13, w13_scale), dequantize_int8(w2, w2_scale))


def dequantize_mxfp4(values, scales, columns: int) -> torch.Tensor:
    """The plain formula in fp32: each code's e2m1 value (table lookup) times 2^(its block's scale - 127)."""
    check_mxfp4_weight(values, scales, columns)
    table = e2m1_table(values.device)
    codes = torch.stack([values & 0x0F, values >> 4], dim=-1).flatten(-2).long()      # [..., N, G*32]
    exponents = scales.float().sub(E8M0_BIAS).repeat_interleave(MXFP4_BLOCK, -1)     # [..., N, G*32]
    return (table[codes] * torch.pow(2.0, exponents))[..., :columns]


def mxfp4_linear(x, values, scales, bias=None) -> torch.Tensor:
    out = F.linear(x.float(), dequantize_mxfp4(values, scales, x.shape[-1]), None if bias is None else bias.float())
    return out.to(x.dtype)


def mxfp4_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale, **epilogue) -> torch.Tensor:
    hidden, intermediate = x_sorted.shape[-1], w13.shape[1] // 2
    return expert_mlp(x_sorted, counts, dequantize_mxfp4(w13, w13_scale, hidden),
                      dequantize_mxfp4(w2, w2_scale, intermediate), **epilogue)


def mxfp4_masked_expert_mlp(x, counts, w13, w13_scale, w2, w2_scale, **epilogue) -> torch.Tensor:
    hidden, intermediate = x.shape[-1], w13.shape[1] // 2
    return masked_expert_mlp(x, counts, dequantize_mxfp4(w13, w13_scale, hidden),
                             dequantize_mxfp4(w2, w2_scale, intermediate), **epilogue)


def int4_linear(x, values, scales, layout: Int4Layout, bias=None, column_groups=None) -> torch.Tensor:
    weight = dequantize_int4(layout, values, scales, x.shape[-1], column_groups)
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def int4_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale, *, layout: Int4Layout, w13_groups=None,
                    w2_groups=None) -> torch.Tensor:
    hidden, intermediate = x_sorted.shape[-1], w13.shape[1] // 2
    return expert_mlp(x_sorted, counts, dequantize_int4(layout, w13, w13_scale, hidden, w13_groups),
                      dequantize_int4(layout, w2, w2_scale, intermediate, w2_groups))


def int4_masked_expert_mlp(x, counts, w13, w13_scale, w2, w2_scale, *, layout: Int4Layout, w13_groups=None,
                           w2_groups=None) -> torch.Tensor:
    hidden, intermediate = x.shape[-1], w13.shape[1] // 2
    return masked_expert_mlp(x, counts, dequantize_int4(layout, w13, w13_scale, hidden, w13_groups),
                             dequantize_int4(layout, w2, w2_scale, intermediate, w2_groups))


def unpermute_reduce(out_sorted, plan: PermutePlan, weights, num_tokens: int) -> torch.Tensor:
    y = torch.zeros(num_tokens, out_sorted.shape[1], dtype=torch.float32, device=out_sorted.device)
    flat_weights = weights.reshape(-1).float()
    for row in range(out_sorted.shape[0]):
        flat = int(plan.flat_index[row])
        y[int(plan.token_index[row])] += flat_weights[flat] * out_sorted[row].float()
    return y.to(out_sorted.dtype)


def fused_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]), with every expert computed on every token."""
    num_experts = w13.shape[0]
    every = all_experts_mlp(x, w13, w2)                                       # [E, T, H]
    valid = (topk_ids >= 0) & (topk_ids < num_experts)                       # [T, K]
    one_hot = F.one_hot(topk_ids.clamp(0, num_experts - 1).long(), num_experts).float()  # [T, K, E]
    mixing = (one_hot * (topk_weights.float() * valid)[..., None]).sum(dim=1)  # [T, E]
    return torch.einsum("te,eth->th", mixing, every).to(x.dtype)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    x32 = x.float()
    variance = (x32 * x32).sum(-1, keepdim=True) / x.shape[-1]
    return weight * (x32 / torch.sqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps: float) -> NormOutput:
    summed = x + residual
    return NormOutput(out=rms_norm(summed, weight, eps), residual=summed)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float, key_starts=None,
                           sinks=None) -> torch.Tensor:
    """Row b reads keys [key_starts[b], context_lens[b]); `sinks` [Hq] joins each head's softmax as one more
    logit with no value (transformers' gpt-oss: concatenated to the scores, its column dropped)."""
    batch, num_q_heads, _ = q.shape
    block_size, num_kv_heads, v_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    out = torch.zeros(batch, num_q_heads, v_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        length = int(context_lens[b])
        first = 0 if key_starts is None else min(int(key_starts[b]), length)
        if length == first:
            continue
        positions = torch.arange(first, length, device=q.device)
        blocks = block_tables[b].long()[positions // block_size]
        keys = k_cache[blocks, positions % block_size].float()               # [L, Hkv, D]
        values = v_cache[blocks, positions % block_size].float()             # [L, Hkv, Dv]
        for head in range(num_q_heads):
            kv_head = head // (num_q_heads // num_kv_heads)
            scores = keys[:, kv_head] @ q[b, head].float() * scale           # [L]
            if sinks is not None:
                scores = torch.cat([scores, sinks[head].float().view(1)])
            probs = torch.softmax(scores, dim=0)[:length - first]
            out[b, head] = probs @ values[:, kv_head]
    return out.to(q.dtype)
