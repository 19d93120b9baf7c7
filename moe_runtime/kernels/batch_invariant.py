"""Batch-invariant kernels (`--deterministic`): a row's result does not depend on the other rows computed with it.

A request's logits are only bitwise reproducible when every reduction over one of its rows runs in the same
order whatever the batch holds, however its prompt was chunked and whichever path (prefill chunk, prefix-cache
hit, decode) computed it. On the CPU torch family three things break that, each measured on the dev machine:

- **BLAS GEMM blocking depends on the row count.** `x @ w.T` gives row 0 different bits for 2..40 rows than
  for one (MKL picks gemv, small-M and blocked kernels by M). A GEMM of one fixed shape gives every row the
  same bits wherever it sits in the tile and whatever the other rows hold, so `invariant_linear` runs every
  projection (attention, experts, router, LM head) as `[ROW_TILE, K] @ [K, N]` tiles, the last one padded;
  `invariant_head_linear` the per-head ones (MLA's absorbed W_UK / W_UV) as `[h, ROW_TILE, K]` batched tiles.
- **Elementwise transcendentals differ between torch's vector body and its scalar tail** (silu and sigmoid: 75
  and 63 of 2000 values; exp and rsqrt agreed). Whether an element lands in the tail depends on where the
  tensor ends, so on the batch. `vector_only` pads a row to a multiple of `VECTOR_WIDTH` and runs the op in
  serial chunks of whole vectors: every element takes the vector body.
- **Attention takes different paths** (SDPA flash over a prefill, a prefix-cache merge, the paged decode bmm),
  each with its own reduction order. `fixed_order_attention` is the one path of all three: scores as inner
  dot products over the head dim, the softmax denominator and the value sums per key block of `KEY_BLOCK`
  positions counted from position 0 (not from a chunk's start), blocks added in position order. MLA
  (DeepSeek-V2/V3, Kimi K2) takes it absorbed on all three paths: the latent cache is one key-value head.

Every remaining reduction is one torch runs per output over a contiguous run of fixed length (the head dim, a
key block, the hidden size), below the size from which torch splits a single output's reduction across
threads (`at::internal::GRAIN_SIZE` elements), so intra-op threads change which thread computes a row, never
its order. Exact operations (add, multiply, max, division, index) need nothing. The MoE combine adds each
token's expert outputs in its local experts' order (`dispatch/grouping.reduce_grouped`'s serial `index_add_`),
which other tokens do not change.

Design after Thinking Machines' "Defeating Nondeterminism in LLM Inference" (fixed reduction orders, no split
over the reduction dimension that depends on the batch) and SGLang's / vLLM's batch-invariant modes; written
for the CPU torch family here.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .expert_activation import ExpertActivation
from .expert_mlp import check_expert_biases, check_expert_weights, check_masked_layout, check_sorted_counts
from .paged_attention import check_paged_inputs
from .paged_prefill_attention import PagedPrefillBatch
from .kernel_set_type import KernelSet
from .permute import PermutePlan
from .rms_norm import NormOutput
from .routing import RoutingConfig, TopK, expert_scores, select_experts

ROW_TILE = 16               # rows of every projection's GEMM: the one M the BLAS sees
VECTOR_WIDTH = 64           # elements an elementwise op's row is padded to a multiple of: two AVX-512 vectors of
                            # bf16 (32 each) or four of fp32, so no element falls in a scalar tail
SERIAL_ELEMENTS = 16384     # elements per elementwise chunk: a multiple of VECTOR_WIDTH, below torch's GRAIN_SIZE
                            # (32768) so torch runs the chunk on one thread, without a split of its own
KEY_BLOCK = 64              # key positions per attention block (from position 0), the denominator's and the
                            # value sums' unit
ATTENTION_ELEMENTS = 1 << 22   # elements of one [rows, heads, KEY_BLOCK, D] score product, bounding query chunks


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias) -> [T, N], every row from a GEMM of the same [ROW_TILE, K] shape."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"invariant_linear: x [T, K] and weight [N, K] must agree, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    rows = x.shape[0]
    padded_rows = -(-rows // ROW_TILE) * ROW_TILE
    padded = x.new_zeros(padded_rows, x.shape[1])                     # [Tp, K]
    padded[:rows] = x
    out = x.new_empty(padded_rows, weight.shape[0])                   # [Tp, N]
    weight_t = weight.t()
    for start in range(0, padded_rows, ROW_TILE):
        torch.mm(padded[start : start + ROW_TILE], weight_t, out=out[start : start + ROW_TILE])
    out = out[:rows]
    return out if bias is None else out + bias


def invariant_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, h, K] times each head's own weight [h, K, N] -> [T, h, N] (MLA's absorbed W_UK and W_UV), every row
    from a batched GEMM of the same [h, ROW_TILE, K] shape (an einsum's bmm blocks by T, as `x @ w.T` does)."""
    if x.dim() != 3 or weight.dim() != 3 or x.shape[1:] != weight.shape[:2]:
        raise ValueError(f"invariant_head_linear: x [T, h, K] and weight [h, K, N] must agree, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    rows, heads, width = x.shape
    tiles = -(-rows // ROW_TILE)
    padded = x.new_zeros(tiles * ROW_TILE, heads, width)                             # [Tp, h, K]
    padded[:rows] = x
    padded = padded.view(tiles, ROW_TILE, heads, width).transpose(1, 2).contiguous()  # [tiles, h, ROW_TILE, K]
    out = x.new_empty(tiles, heads, ROW_TILE, weight.shape[2])                        # [tiles, h, ROW_TILE, N]
    for tile in range(tiles):
        torch.bmm(padded[tile], weight, out=out[tile])
    return out.transpose(1, 2).reshape(tiles * ROW_TILE, heads, weight.shape[2])[:rows]   # [T, h, N]


def vector_only(op, *inputs: torch.Tensor) -> torch.Tensor:
    """`op(*inputs)` for same-shaped inputs [R, W] of an elementwise op, each element computed by torch's
    vectorized body: rows padded with zeros to a multiple of VECTOR_WIDTH, then serial chunks of whole rows."""
    rows, width = inputs[0].shape
    padded_width = -(-width // VECTOR_WIDTH) * VECTOR_WIDTH
    chunk_rows = max(1, SERIAL_ELEMENTS // padded_width)
    padded = []
    for tensor in inputs:
        wide = tensor.new_zeros(rows, padded_width)                  # [R, Wp] contiguous
        wide[:, :width] = tensor
        padded.append(wide)
    pieces = [op(*(wide[start : start + chunk_rows] for wide in padded)) for start in range(0, rows, chunk_rows)]
    if not pieces:
        return op(*inputs)
    return torch.cat(pieces)[:, :width]


def tiled_rows(counts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Where each row of a layout grouped by expert (`counts` [E] rows each) goes when every expert's rows are
    padded to whole ROW_TILE tiles: positions [N], and the padded starts [E] on the host."""
    padded_counts = (counts + ROW_TILE - 1) // ROW_TILE * ROW_TILE                      # [E]
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts                      # [E]
    expert_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)   # [N]
    slot_of_row = torch.arange(expert_of_row.shape[0], device=counts.device) - (torch.cumsum(counts, 0)
                                                                                - counts)[expert_of_row]
    return padded_starts[expert_of_row] + slot_of_row, padded_starts.tolist()


def tiled_expert_swiglu(x_tiles: torch.Tensor, segments: list[tuple[int, int, int]], w13: torch.Tensor,
                        w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
                        activation: ExpertActivation) -> torch.Tensor:
    """Every expert's w2 @ act(w13 @ x + b13) + b2 on its rows of x_tiles [Np, H] (each expert's rows whole
    ROW_TILE tiles: `segments` (expert, start, padded rows)), every GEMM [ROW_TILE, K] -> [Np, H]."""
    intermediate = w13.shape[1] // 2
    gate_up = tiled_expert_linear(x_tiles, segments, w13, b13)                                # [Np, 2I]
    activated = vector_only(activation.apply, gate_up[:, :intermediate], gate_up[:, intermediate:])   # [Np, I]
    return tiled_expert_linear(activated, segments, w2, b2)                                  # [Np, H]


def tiled_expert_linear(rows: torch.Tensor, segments: list[tuple[int, int, int]], weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """Each expert's rows of `rows` [Np, K] times its weight [E, N, K].T (+ its bias [E, N]), one [ROW_TILE, K]
    GEMM per tile -> [Np, N]."""
    out = rows.new_empty(rows.shape[0], weight.shape[1])                                     # [Np, N]
    for expert, start, count in segments:
        transposed = weight[expert].t()
        for tile in range(start, start + count, ROW_TILE):
            torch.mm(rows[tile : tile + ROW_TILE], transposed, out=out[tile : tile + ROW_TILE])
        if bias is not None:
            out[start : start + count] += bias[expert].to(out.dtype)
    return out


def invariant_expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                         b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                         activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:   # [N, H]
    """`expert_mlp`'s contract (rows grouped by expert, unweighted outputs): each busy expert's rows padded to
    whole ROW_TILE tiles, so a row's GEMMs never depend on how many rows its expert got (never the padded
    all-experts form either, whose row count is the busiest expert's)."""
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    check_expert_biases(w13, w2, b13, b2)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    if x_sorted.shape[0] == 0:
        return x_sorted.new_empty(0, w2.shape[1])
    positions, starts = tiled_rows(counts)
    padded_counts = ((counts + ROW_TILE - 1) // ROW_TILE * ROW_TILE).tolist()
    segments = [(e, starts[e], rows) for e, rows in enumerate(padded_counts) if rows]
    x_tiles = x_sorted.new_zeros(sum(padded_counts), x_sorted.shape[1])                  # [Np, H]
    x_tiles[positions] = x_sorted
    return tiled_expert_swiglu(x_tiles, segments, w13, w2, b13, b2, activation)[positions]


def invariant_masked_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                                activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:  # [E, M, H]
    """The masked layout [E, M, H]: expert e's first counts[e] rows as `invariant_expert_mlp` computes them,
    zeros past them."""
    check_masked_layout(x, counts, w13.shape[0])
    valid = torch.arange(x.shape[1], device=x.device) < counts.unsqueeze(1)              # [E, M]
    rows = invariant_expert_mlp(x[valid], counts, w13, w2, b13=b13, b2=b2, activation=activation)   # [N, H]
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[1], dtype=x.dtype, device=x.device)
    out[valid] = rows
    return out


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of x [T, N] (a gate: Qwen2-MoE's shared expert), every element from torch's vector body."""
    return vector_only(torch.sigmoid, x)


def invariant_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:   # [T, E] fp32 -> [T, E]
    """`expert_scores` with the elementwise scorings (sigmoid, sqrt-softplus) in the vector body; softmax is one row
    at a time in torch already."""
    if scoring == "softmax":
        return expert_scores(logits, scoring)
    return vector_only(lambda rows: expert_scores(rows, scoring), logits)


def invariant_select_experts(router_logits: torch.Tensor, config: RoutingConfig,
                             correction_bias: torch.Tensor | None = None) -> TopK:
    """`select_experts` with `invariant_scores`: choosing (bias, groups, top-k) and weighing are exact per row."""
    return select_experts(router_logits, config, correction_bias, scores_of=invariant_scores)


def invariant_unpermute_reduce(out_sorted: torch.Tensor, plan: PermutePlan, weights: torch.Tensor,
                               num_tokens: int) -> torch.Tensor:   # [T, H]
    """Each token's weighted expert outputs added in its top-k order (k = 0, 1, ...), fp32."""
    if out_sorted.shape[0] != plan.num_rows:
        raise ValueError(f"out_sorted has {out_sorted.shape[0]} rows but the plan has {plan.num_rows}")
    top_k, hidden = weights.shape[1], out_sorted.shape[1]
    row_of_pair = torch.zeros(num_tokens * top_k, dtype=torch.int64, device=out_sorted.device)    # [T*K]
    row_of_pair[plan.flat_index] = torch.arange(plan.num_rows, device=out_sorted.device)
    kept = torch.zeros(num_tokens * top_k, dtype=torch.float32, device=out_sorted.device)         # [T*K]
    kept[plan.flat_index] = weights.reshape(-1).float()[plan.flat_index]
    if plan.num_rows == 0:
        return out_sorted.new_zeros(num_tokens, hidden)
    pairs = out_sorted[row_of_pair].float().view(num_tokens, top_k, hidden)                         # [T, K, H]
    kept = kept.view(num_tokens, top_k, 1)
    total = pairs[:, 0] * kept[:, 0]
    for k in range(1, top_k):
        total = total + pairs[:, k] * kept[:, k]
    return total.to(out_sorted.dtype)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face RMSNorm, each row's mean of squares one serial reduction over the row (rows chunked below
    the size at which torch would split a lone row's sum across threads)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must be [{x.shape[-1]}], got shape {tuple(weight.shape)}")
    flat = x.reshape(-1, x.shape[-1]).float()                                                       # [R, H]
    chunk_rows = max(1, SERIAL_ELEMENTS // max(1, flat.shape[1]))
    mean_square = torch.cat([flat[start : start + chunk_rows].pow(2).mean(-1, keepdim=True)
                             for start in range(0, flat.shape[0], chunk_rows)] or [flat.new_zeros(0, 1)])
    normed = flat * torch.rsqrt(mean_square + eps)
    return weight * normed.to(x.dtype).view(x.shape)


def invariant_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> NormOutput:
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    summed = x + residual
    return NormOutput(out=invariant_rms_norm(summed, weight, eps), residual=summed)


def last_dim_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(a * b).sum(-1) over broadcast operands, the product laid out contiguously first: each output is then one
    serial reduction over a contiguous run of the last dim's length, whatever the other dims hold (a broadcast
    product may otherwise take its inputs' memory order, and the sum another kernel)."""
    return (a * b).contiguous().sum(-1)


def fixed_order_attention(
    q: torch.Tensor,          # [G, n, Hq, D]: n query rows of each of G key sets
    keys: torch.Tensor,       # [G, S, Hkv, D]: the key set's positions 0..S-1, S a multiple of KEY_BLOCK
    values: torch.Tensor,     # [G, S, Hkv, Dv]
    visible: torch.Tensor,    # [G, n, S] bool: which keys each row reads (its span, causally)
    scale: float,
    sinks: torch.Tensor | None = None,   # [Hq] fp32 sink logits
) -> torch.Tensor:            # [G, n, Hq, Dv] fp32
    """Softmax attention with one reduction order for a row whatever else is computed: keys are zeroed where
    the key set holds nothing a row of it reads (a freed block may hold NaN), scores are inner products over D,
    and each row's denominator and value sum add KEY_BLOCK-position blocks in position order."""
    groups, rows, q_heads, head_dim = q.shape
    kv_heads, value_dim, length = keys.shape[2], values.shape[3], keys.shape[1]
    if length % KEY_BLOCK:
        raise ValueError(f"fixed_order_attention: keys must be padded to a multiple of {KEY_BLOCK}, got {length}")
    group = q_heads // kv_heads
    read = visible.any(dim=1)                                                        # [G, S]
    keys = torch.where(read[:, :, None, None], keys.float(), 0.0).permute(0, 2, 1, 3).contiguous()  # [G, Hkv, S, D]
    values_t = torch.where(read[:, :, None, None], values.float(), 0.0).permute(0, 2, 3, 1).contiguous()  # [G,Hkv,Dv,S]
    q = q.float().view(groups, rows, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).contiguous()  # [G,Hkv,g,n,D]
    blocks = length // KEY_BLOCK
    scores = torch.empty(groups, kv_heads, group, rows, length, dtype=torch.float32, device=q.device)
    for b in range(blocks):                                                          # [G, Hkv, g, n, KB]
        key_block = keys[:, :, None, None, b * KEY_BLOCK : (b + 1) * KEY_BLOCK, :]    # [G, Hkv, 1, 1, KB, D]
        scores[..., b * KEY_BLOCK : (b + 1) * KEY_BLOCK] = last_dim_dot(q[:, :, :, :, None, :], key_block)
    scores.mul_(scale).masked_fill_(~visible[:, None, None, :, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)                                          # [G, Hkv, g, n, 1]
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, group, 1, 1)
        top = torch.maximum(top, sink)
    top = torch.where(torch.isfinite(top), top, 0.0)                                 # a row with nothing to read
    probs = vector_only(torch.exp, (scores - top).view(-1, KEY_BLOCK)).view(scores.shape)   # masked: 0
    block_sums = probs.view(*probs.shape[:-1], blocks, KEY_BLOCK).sum(-1)             # [G, Hkv, g, n, blocks]
    denominator, numerator = None, None
    for b in range(blocks):                                                          # position order
        block = slice(b * KEY_BLOCK, (b + 1) * KEY_BLOCK)
        block_out = last_dim_dot(probs[..., None, block], values_t[:, :, None, None, :, block])   # [G,Hkv,g,n,Dv]
        denominator = block_sums[..., b] if b == 0 else denominator + block_sums[..., b]
        numerator = block_out if b == 0 else numerator + block_out
    if sinks is not None:
        denominator = denominator + vector_only(torch.exp, (sink - top).reshape(-1, 1)).view(denominator.shape)
    out = numerator / torch.where(denominator > 0, denominator, 1.0)[..., None]       # [G, Hkv, g, n, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(groups, rows, q_heads, value_dim)        # fp32


def padded_length(length: int) -> int:
    return max(KEY_BLOCK, -(-length // KEY_BLOCK) * KEY_BLOCK)


def gather_keys(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[blocks, bs, H, D] cache, block tables [..., W] (-1 padded) -> each table's positions 0..length-1,
    [..., length, H, D] (positions past its blocks are zeros); `length` a multiple of KEY_BLOCK."""
    tables = block_tables.long().clamp(min=0)
    rows = cache.index_select(0, tables.reshape(-1))                                  # [n*W, bs, H, D]
    rows = rows.view(*tables.shape[:-1], -1, *cache.shape[2:])                        # [..., W*bs, H, D]
    take = min(length, rows.shape[-3])
    out = cache.new_zeros(*tables.shape[:-1], length, *cache.shape[2:])
    out[..., :take, :, :] = rows[..., :take, :, :]
    return out


def invariant_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, key_starts=None, sinks=None):
    """The paged decode kernel's contract ([B, Hq, D] -> [B, Hq, Dv]), through `fixed_order_attention`."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, key_starts, sinks)
    batch = q.shape[0]
    if batch == 0:
        return q.new_zeros(0, q.shape[1], v_cache.shape[3])
    padded = padded_length(block_tables.shape[1] * k_cache.shape[1])
    keys = gather_keys(k_cache, block_tables, padded)                                             # [B, Sp, Hkv, D]
    values = gather_keys(v_cache, block_tables, padded)                                           # [B, Sp, Hkv, Dv]
    positions = torch.arange(padded, device=q.device)
    visible = positions[None, :] < context_lens.long()[:, None]                                   # [B, Sp]
    if key_starts is not None:
        visible &= positions[None, :] >= key_starts.long()[:, None]
    out = fixed_order_attention(q[:, None], keys, values, visible[:, None, :], scale, sinks)      # [B, 1, Hq, Dv]
    return out[:, 0].to(q.dtype)


def invariant_prefill_attention(q, k_cache, v_cache, batch: PagedPrefillBatch, scale, span=None, sinks=None):
    """The varlen prefill kernel's contract (q [T, Hq, D] packed by sequence -> [T, Hq, Dv]), one sequence at a
    time through `fixed_order_attention`, query rows chunked to bound the score product's memory."""
    outputs = []
    start = 0
    for seq, (rows, context) in enumerate(zip(batch.query_lens, batch.context_lens_host)):
        padded = padded_length(context)
        keys = gather_keys(k_cache, batch.block_tables[seq : seq + 1], padded)      # [1, Sp, Hkv, D]
        values = gather_keys(v_cache, batch.block_tables[seq : seq + 1], padded)    # [1, Sp, Hkv, Dv]
        key_pos = torch.arange(padded, device=q.device)[None, :]                     # [1, Sp]
        chunk = max(1, ATTENTION_ELEMENTS // (q.shape[1] * KEY_BLOCK * q.shape[2]))
        for first in range(0, rows, chunk):
            last = min(rows, first + chunk)
            query_pos = torch.arange(context - rows + first, context - rows + last, device=q.device)[:, None]
            visible = (key_pos <= query_pos) if span is None else span.visible(query_pos, key_pos)
            visible = visible & (key_pos < context)                                  # [n, Sp]
            outputs.append(fixed_order_attention(q[start + first : start + last][None], keys, values,
                                                 visible[None], scale, sinks)[0])    # [n, Hq, Dv]
        start += rows
    if not outputs:
        return q.new_zeros(0, q.shape[1], v_cache.shape[3])
    return torch.cat(outputs).to(q.dtype)


BATCH_INVARIANT = "batch_invariant"


def not_batch_invariant(kernel: str):
    """A kernel entry the batch-invariant family has no fixed-order twin of: refuses by name when called
    (`moe_runtime/config/deterministic.py` refuses the options that would reach it before anything loads)."""
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"--deterministic: the {kernel} kernel has no batch-invariant version yet")
    return refuse


def batch_invariant_kernels(base: KernelSet) -> KernelSet:
    """The torch family with every reduction a row goes through in a fixed order: projections, the router's logits
    (`linear_rows`) and scores (`select_experts`), the LM head, expert MLPs, RMSNorm, the top-k combine and decode
    attention (the attention backend pairs it with `invariant_prefill_attention` for this family). The quantized,
    captured-step and fused entries refuse."""
    refused = {name: not_batch_invariant(name) for name in (
        "pair_expert_mlp", "fused_moe", "fp8_linear", "fp8_expert_mlp", "fp8_masked_expert_mlp", "int8_linear",
        "int8_expert_mlp", "int8_masked_expert_mlp", "mxfp4_linear", "mxfp4_expert_mlp", "mxfp4_masked_expert_mlp",
        "int4_linear", "int4_expert_mlp", "int4_masked_expert_mlp")}
    return replace(base, name=BATCH_INVARIANT, select_experts=invariant_select_experts, expert_mlp=invariant_expert_mlp,
                   masked_expert_mlp=invariant_masked_expert_mlp, unpermute_reduce=invariant_unpermute_reduce,
                   linear_rows=invariant_linear, rms_norm=invariant_rms_norm,
                   fused_add_rms_norm=invariant_fused_add_rms_norm,
                   paged_decode_attention=invariant_decode_attention, **refused)
