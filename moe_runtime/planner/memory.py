"""Weights and KV cache of one rank under a layout, and the KV capacity they leave, by the runtime's rules.

Where each weight lies (moe_runtime/models/decoder.py, moe/layer.py): attention heads split over attention TP
(tp for dense models, ep / dp_attn / cp for MoE ones); dense MLPs, shared experts, the embedding and the LM
head split too only under dense TP (`dense_tp`), else every rank holds them whole; routed experts split over
ep as (experts + redundant) / ep slots per rank; pipeline stages hold their layers (the first stage the
embedding, the last the LM head, both when tied).

KV capacity is `kv_blocks_for_budget` (moe_runtime/execution/model_runner.py): each rank pays its windowed
groups' fixed pools (every running sequence's window plus a step's tokens, and a scratch block) out of
`kv_cache_memory`, and fills the rest with blocks of its full layers; the job keeps the smallest block count
of any rank, per DP worker. Why the KV per token is what it is: model_shape.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.config.quantization_choice import INT4, NO_QUANTIZATION, AskedQuantization, kept_quantization
from moe_runtime.planner.model_shape import FULL, LINEAR, LayerShape, ModelShape

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
# per weight, scales included (int4: a float32 scale per 128 columns, the layout a float release is quantized to at
# load; an int4 release's experts are priced in their own layout: `Precision.int4_expert_bytes`)
QUANT_BYTES = {"fp8": 1 + 4 / 128, "int8": 1 + 4 / 1024, "mxfp4": 0.5 + 1 / 32, "int4": 0.5 + 4 / 128}


@dataclass(frozen=True)
class Precision:
    """--dtype and --quantization as bytes: fp8 and int8 keep projections and experts quantized (dequantized
    per matmul tile, so the math runs at the compute dtype's rate), mxfp4 and int4 only the routed experts; "none"
    (and None) every weight in the compute dtype."""

    dtype: str
    quantization: str | None = None
    int4_expert_bytes: float | None = None   # int4 kept in an int4 release's own layout (None: QUANT_BYTES')
    automatic: bool = False   # int4 kept by itself (an int4 release, --quantization unset): no flag asks for it

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def linear_bytes(self) -> float:
        """Per weight of attention, dense MLPs and shared experts."""
        if self.quantization in ("fp8", "int8"):
            return QUANT_BYTES[self.quantization]
        return self.compute_bytes

    @property
    def expert_bytes(self) -> float:
        if self.quantization == INT4 and self.int4_expert_bytes is not None:
            return self.int4_expert_bytes
        return QUANT_BYTES[self.quantization] if self.quantization in QUANT_BYTES else self.compute_bytes


def resolve_precision(shape: ModelShape, dtype: str, quantization: str | None, cpu_experts: bool = False,
                      enable_torch_compile: bool = False, deterministic: bool = False) -> Precision:
    """`--dtype auto` is the checkpoint's dtype, float32 when unset (EngineConfig.resolved_dtype's rule); the
    --quantization kept is the engine's own rule's (config/quantization_choice.py) on what config.json declares:
    an int4 release's experts, unless told otherwise, stay int4 in the layout they ship in."""
    if dtype == "auto":
        dtype = shape.checkpoint_dtype if shape.checkpoint_dtype in DTYPE_BYTES else "float32"
    stored = shape.int4_experts
    asked = AskedQuantization(quantization, dtype, cpu_experts, enable_torch_compile, deterministic)
    kept = kept_quantization(asked, stored is not None)
    if kept.quantization == INT4 and stored is not None:   # --quantization int4 keeps a release's own layout too
        return Precision(dtype, INT4, stored.bytes_per_weight(shape.hidden_size, shape.expert_intermediate),
                         kept.automatic)
    return Precision(dtype, quantization if quantization == NO_QUANTIZATION else kept.quantization)


@dataclass(frozen=True)
class StageMemory:
    """One rank of one pipeline stage."""

    layers: tuple[LayerShape, ...]
    weight_bytes: float
    full_kv_bytes_per_token: int      # the full group's bytes per token (what decides the block count)
    fixed_bytes: int                  # windowed pools (with scratch) and linear-attention state slots

    def kv_blocks(self, budget: int, block_size: int) -> int | None:
        """`kv_blocks_for_budget`; None where this stage holds no full layer (the other stages decide)."""
        left = budget - self.fixed_bytes
        if self.full_kv_bytes_per_token == 0:
            return None
        return max(left // (self.full_kv_bytes_per_token * block_size), 0)


@dataclass(frozen=True)
class RankMemory:
    stages: tuple[StageMemory, ...]

    @property
    def weight_bytes(self) -> float:
        """The heaviest rank's weights (what must fit on every GPU)."""
        return max(s.weight_bytes for s in self.stages)

    @property
    def kv_bytes_per_token(self) -> int:
        return max(s.full_kv_bytes_per_token for s in self.stages)

    def kv_blocks(self, budget: int, block_size: int) -> int:
        """Blocks per DP worker: the smallest any rank fits (the job agrees on the minimum)."""
        counts = [b for b in (s.kv_blocks(budget, block_size) for s in self.stages) if b is not None]
        return min(counts) if counts else max(budget // block_size, 0)


def kv_bytes_per_token(layer: LayerShape, attn_tp: int, dtype_bytes: int) -> int:
    """One rank's K/V bytes per token of `layer` (GQA heads split or replicated, MLA's latent whole)."""
    if layer.span == LINEAR:
        return 0
    heads = layer.kv_heads
    if layer.kv_split:
        heads = heads // attn_tp if heads >= attn_tp else 1
    return heads * layer.kv_dim * dtype_bytes


@dataclass(frozen=True)
class ModelFootprint:
    """The two numbers a plan starts from, for the whole model on one device (no parallelism): its weights and
    the KV bytes one more token of context costs (full-attention layers; windowed layers stop growing at their
    window, linear-attention layers keep a fixed state)."""

    weight_bytes: float
    kv_bytes_per_token: int
    windowed_kv_bytes_per_token: int

    @classmethod
    def of(cls, shape: ModelShape, precision: Precision) -> "ModelFootprint":
        dt = precision.compute_bytes
        whole = rank_memory(shape, ParallelLayout(), precision, max_num_seqs=1, max_num_batched_tokens=1)
        full = sum(kv_bytes_per_token(layer, 1, dt) for layer in shape.layers if layer.span == FULL)
        windowed = sum(kv_bytes_per_token(layer, 1, dt) for layer in shape.layers
                       if layer.span not in (FULL, LINEAR))
        return cls(whole.weight_bytes, full, windowed)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """A windowed group's pool: each running sequence's reach (ceil(W / block) + 2) plus a full step's blocks
    (the bound moe_runtime/kv_blocks/kv_groups.py sizes it by, so that no step waits for a windowed block)."""
    return max_num_seqs * (-(-window // block_size) + 2) + -(-max_num_batched_tokens // block_size)


def grouped_full(shape: ModelShape) -> list[bool]:
    """Per layer: whether it caches in the full group. Windowed layers form groups of their own only beside full
    ones; a model whose attention layers are all windowed (or all full) keeps one group (KVGroups.of_layers)."""
    attention = [l for l in shape.layers if l.span != LINEAR]
    windowed = [l.span != FULL for l in attention]
    one_group = all(windowed) or not any(windowed)
    return [l.span != LINEAR and (one_group or l.span == FULL) for l in shape.layers]


def rank_memory(shape: ModelShape, layout: ParallelLayout, precision: Precision, block_size: int = 16,
                max_num_seqs: int = 64, max_num_batched_tokens: int = 4096) -> RankMemory:
    dense_tp = layout.tp > 1
    attn_tp = layout.attn_tp
    slots_per_rank = (shape.num_experts + layout.num_redundant_experts) // max(layout.ep, 1)
    in_full = grouped_full(shape)
    dt = precision.compute_bytes
    stages, first = [], 0
    per_stage = layout.stage_layers(shape.num_layers)
    for index, count in enumerate(per_stage):
        layers = shape.layers[first:first + count]
        full_flags = in_full[first:first + count]
        first += count
        split_dense = attn_tp if dense_tp else 1
        weights = 0.0
        for layer in layers:
            weights += layer.attention_params / attn_tp * precision.linear_bytes
            weights += (layer.dense_params + layer.shared_params) / split_dense * precision.linear_bytes
            weights += layer.router_params * dt
            weights += slots_per_rank * layer.expert_params * precision.expert_bytes
        vocab_matrix = shape.vocab_size * shape.hidden_size / split_dense * dt
        tied = shape.embedding_params == shape.vocab_size * shape.hidden_size
        last = index == len(per_stage) - 1
        weights += vocab_matrix * ((index == 0) + (last and (not tied or index > 0)))
        full = sum(kv_bytes_per_token(l, attn_tp, dt) for l, f in zip(layers, full_flags) if f)
        fixed = 0
        for layer, f in zip(layers, full_flags):
            if layer.state_fp32 or layer.state_conv:   # one state slot per running sequence, and a scratch one
                heads_share = attn_tp if layer.kv_split else 1
                fixed += (max_num_seqs + 1) * (layer.state_fp32 * 4 + layer.state_conv * dt) // heads_share
            if layer.span != LINEAR and not f:
                pool = window_pool_blocks(layer.window, block_size, max_num_seqs, max_num_batched_tokens)
                fixed += kv_bytes_per_token(layer, attn_tp, dt) * block_size * (pool + 1)
        stages.append(StageMemory(tuple(layers), weights, full, fixed))
    return RankMemory(tuple(stages))


@dataclass(frozen=True)
class KVCapacity:
    blocks_per_worker: int
    block_size: int
    dp_size: int
    blocks_per_request: int

    @property
    def tokens_per_worker(self) -> int:
        return self.blocks_per_worker * self.block_size

    @property
    def tokens(self) -> int:
        """Tokens the instance's KV cache holds (every DP worker's)."""
        return self.tokens_per_worker * self.dp_size

    @property
    def requests_per_worker(self) -> int:
        return self.blocks_per_worker // self.blocks_per_request

    @property
    def requests(self) -> int:
        """Requests of the asked length that run at once, every one with its whole context cached."""
        return self.requests_per_worker * self.dp_size


def kv_capacity(memory: RankMemory, layout: ParallelLayout, budget: int, block_size: int,
                request_tokens: int) -> KVCapacity:
    blocks = memory.kv_blocks(budget, block_size)
    return KVCapacity(blocks, block_size, layout.dp_size, max(-(-request_tokens // block_size), 1))


def host_tier_tokens(host_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Tokens of evicted prefixes one rank's host tier (--kv-host-memory, per rank) keeps: whole blocks of the
    rank's shard of the full layers, each counted at the largest shard of any rank of the job (as the tier counts
    its entries: moe_runtime/kv_tiers/entry_sizes.py, so a worker's ranks keep the same tokens). A hybrid model's
    state snapshots and windowed layers' blocks share the tier and are not counted: an upper bound for them."""
    if host_bytes <= 0 or kv_bytes_per_token <= 0:
        return 0
    return host_bytes // (kv_bytes_per_token * block_size) * block_size
