"""What the planner's arithmetic needs of a model, read from its config.json without loading transformers or torch.

`moe-serve plan` must answer in well under a second, so the shape comes from the JSON itself: parameter
counts per layer kind (attention, dense MLP, shared and routed experts, router), the routed experts and how
many each token visits, and the KV bytes per token of each layer as the runtime stores them: GQA keeps K and
V of every KV head, MLA one latent of kv_lora_rank + qk_rope_head_dim (moe_runtime/layers/mla.py), windowed
layers (sliding, chunked) are bounded by their window because their KV cache group keeps only that
(moe_runtime/kv_blocks/kv_groups.py), and linear-attention layers keep a fixed state per sequence.

The per-architecture rules (which layers are MoE, which size the experts have) follow the model builders in
moe_runtime/models/; tests/test_plan.py holds the set of architectures read here equal to the registry's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from moe_runtime.config.multimodal_wrappers import WRAPPERS
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.planner.config_checks import ConfigError, check_config, read_config, text_config_of
from moe_runtime.planner.int4_experts import Int4Experts, int4_experts_of


FULL, SLIDING, CHUNKED, LINEAR = "full", "sliding", "chunked", "linear"

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM",
                     "Llama4ForCausalLM", "GptOssForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM",
                     "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV4ForCausalLM")
QWEN_SPARSE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
PLANNED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
ALIASES = {name: wrapper.text_architecture for name, wrapper in WRAPPERS.items()}   # a multimodal release's text model


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: parameters by kind and what its attention keeps per token."""

    attention_params: int          # q/k/v/o (or MLA's projections), split by attention TP
    dense_params: int              # a dense MLP (0 on MoE layers), split by TP
    shared_params: int             # shared experts of an MoE layer, split by attention TP
    expert_params: int             # ONE routed expert's gate/up/down (0 on dense layers)
    router_params: int             # the router (replicated)
    kv_heads: int                  # heads of K/V the cache stores (MLA: 1 latent head, whole on every rank)
    kv_dim: int                    # channels per head of K plus V (MLA: the latent and rope key, no V)
    kv_split: bool                 # whether attention TP splits the KV heads (GQA yes, MLA no)
    span: str = FULL               # FULL, SLIDING, CHUNKED or LINEAR
    window: int | None = None      # tokens a windowed layer keeps
    state_fp32: int = 0            # a linear-attention layer's recurrent state per sequence (float32 elements)
    state_conv: int = 0            # ... and its short convolution's last inputs (elements of the compute dtype);
                                   # DeepSeek-V4: its window's keys and carried compressor projections

    @property
    def moe(self) -> bool:
        return self.expert_params > 0


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    hidden_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    layers: tuple[LayerShape, ...]
    num_experts: int               # routed experts per MoE layer (1: dense)
    top_k: int                     # routed experts each token visits
    embedding_params: int          # embedding + LM head (one matrix when tied)
    max_position_embeddings: int
    checkpoint_dtype: str          # torch_dtype of the checkpoint ("bfloat16", ...)
    checkpoint_quantization: str | None   # quantization_config.quant_method (fp8, mxfp4) or None
    config: dict = field(repr=False, compare=False, default_factory=dict)
    block_multiple: int = 1        # --block-size must be a multiple of it (DeepSeek-V4: its compression rates)

    def block_size_for(self, requested: int) -> int:
        """The smallest block size the runtime takes for this model, at least `requested`."""
        return math.lcm(requested, self.block_multiple)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def int4_experts(self) -> Int4Experts | None:
        """The routed experts' int4 grouping where config.json declares them int4 (AWQ, GPTQ, compressed-tensors
        pack-quantized int4 schemes that take them): the engine then keeps them so unless told otherwise
        (config/quantization_choice.py)."""
        if not self.is_moe:
            return None
        return int4_experts_of(self.config.get("quantization_config"), self.architecture)

    @property
    def expert_intermediate(self) -> int:
        """A routed expert's intermediate size (0: dense)."""
        return next((layer.expert_params // (3 * self.hidden_size) for layer in self.layers if layer.moe), 0)

    @property
    def total_params(self) -> int:
        per_layer = sum(self.layer_params(layer) for layer in self.layers)
        return per_layer + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies (the embedding lookup is not a matmul: only the LM head)."""
        head = self.vocab_size * self.hidden_size
        return head + sum(l.attention_params + l.dense_params + l.shared_params + l.router_params
                          + self.top_k * l.expert_params for l in self.layers)

    def layer_params(self, layer: LayerShape) -> int:
        return (layer.attention_params + layer.dense_params + layer.shared_params + layer.router_params
                + self.num_experts * layer.expert_params)

    def hf_namespace(self) -> SimpleNamespace:
        """The config as attributes: what `ParallelLayout.validate` reads (no transformers needed)."""
        return SimpleNamespace(**self.config)


def load_model_shape(model: str | Path) -> ModelShape:
    """A checkpoint directory or its config.json (a multimodal one's text_config is the model)."""
    return model_shape_of(read_config(model))


def model_shape_of(config: dict) -> ModelShape:
    """The shape of a parsed config.json; every field it reads is checked first (config_checks.py), and a
    config that still does not add up is a ConfigError, never a traceback."""
    architectures = config.get("architectures")
    if architectures is not None and (not isinstance(architectures, list)
                                      or not all(isinstance(a, str) for a in architectures)):
        raise ConfigError("architectures", "must be a list of class names")
    architecture = (architectures or ["?"])[0]
    architecture = ALIASES.get(architecture, architecture)
    text_config = text_config_of(config)
    if text_config is not None:   # a multimodal checkpoint: the decoder's fields sit there
        config = {**text_config, "architectures": [architecture],
                  "torch_dtype": config.get("torch_dtype", text_config.get("torch_dtype")),
                  "quantization_config": config.get("quantization_config") or text_config.get("quantization_config")}
    if architecture not in PLANNED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} (config.json 'architectures') is not one the runtime serves; "
            f"supported: {', '.join(sorted(PLANNED_ARCHITECTURES))}")
    check_config(config, moe=architecture in MOE_ARCHITECTURES)
    try:
        return _shape(config, architecture)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError) as exc:
        raise ConfigError("config.json", f"does not add up to a {architecture} ({type(exc).__name__}: "
                                         f"{str(exc)[:120]})") from None


def _shape(config: dict, architecture: str) -> ModelShape:
    c = SimpleNamespace(**config)
    hidden, heads = c.hidden_size, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    experts = _num_experts(config) if architecture in MOE_ARCHITECTURES else 1
    layers = tuple(_layer(c, architecture, i, hidden, heads, head_dim, experts) for i in range(c.num_hidden_layers))
    tied = bool(getattr(c, "tie_word_embeddings", False))
    quant = (config.get("quantization_config") or {}).get("quant_method")
    return ModelShape(
        architecture=architecture, hidden_size=hidden, vocab_size=c.vocab_size, num_heads=heads, head_dim=head_dim,
        layers=layers, num_experts=experts, top_k=int(getattr(c, "num_experts_per_tok", 1) or 1) if experts > 1 else 1,
        embedding_params=c.vocab_size * hidden * (1 if tied else 2),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048) or 2048),
        checkpoint_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        checkpoint_quantization=quant, config={**config, "architectures": [architecture]},
        block_multiple=_compression_rates_lcm(config) if architecture == "DeepseekV4ForCausalLM" else 1)


def _compression_rates_lcm(config: dict) -> int:
    """DeepSeek-V4 pages a block's compressed entries in it: blocks a multiple of every compression rate."""
    rates = [rate for kind, rate in (config.get("compress_rates") or {}).items() if kind in config["layer_types"]]
    return math.lcm(1, *rates)


def _num_experts(config: dict) -> int:
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):   # ParallelLayout's order
        if config.get(name):
            return int(config[name])
    return 1


def _layer(c, architecture: str, i: int, hidden: int, heads: int, head_dim: int, experts: int) -> LayerShape:
    if architecture == "DeepseekV4ForCausalLM":
        return _deepseek_v4_layer(c, i, hidden, heads, head_dim, experts)
    span, window = _span(c, i)
    if span == LINEAR:
        attention, state_fp32, state_conv = _linear_attention(c, hidden)
        kv_heads = kv_dim = 0
        kv_split = True
    else:
        attention, kv_heads, kv_dim, kv_split = _attention(c, hidden, heads, head_dim)
        if _has_indexer(c, i):   # DeepSeek Sparse Attention: the indexer's projections, an index key per token
            attention += _indexer_params(c, hidden)
            kv_dim += c.index_head_dim
        state_fp32 = state_conv = 0
    dense = shared = expert = router = 0
    if experts > 1 and _is_moe_layer(c, architecture, i):
        expert_inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        expert = 3 * hidden * expert_inter
        router = hidden * experts
        shared = 3 * hidden * _shared_intermediate(c, architecture, expert_inter)
    else:
        dense = 3 * hidden * (getattr(c, "intermediate_size_mlp", None) or c.intermediate_size)
    return LayerShape(attention, dense, shared, expert, router, kv_heads, kv_dim, kv_split, span, window, state_fp32,
                      state_conv)


def _deepseek_v4_layer(c, i: int, hidden: int, heads: int, head_dim: int, experts: int) -> LayerShape:
    """A DeepSeek-V4 layer as moe_runtime/layers/compressed_cache.py keeps it: per token its compressed entries
    (head_dim, and a CSA layer's index key, over the rate), paged with the full group; per sequence the window's
    keys and the compressors' carried projections (a sliding-only layer keeps only those: a state layer)."""
    kind = c.layer_types[i]
    rate = c.compress_rates.get(kind, 0) if kind != "sliding_attention" else 0
    csa = kind == "compressed_sparse_attention"
    index_dim = c.index_head_dim if csa else 0
    q_lora, o_lora = c.q_lora_rank, c.o_lora_rank
    attention = (hidden * q_lora + q_lora * heads * head_dim + hidden * head_dim + heads * head_dim * o_lora
                 + c.o_groups * o_lora * hidden)
    projection = (2 if csa else 1) * head_dim
    carried = (2 if csa else 1) * rate
    if rate:
        attention += 2 * hidden * projection
    if csa:
        attention += q_lora * c.index_n_heads * index_dim + hidden * c.index_n_heads + 4 * hidden * index_dim
    state = c.sliding_window * head_dim + carried * 2 * (projection + 2 * index_dim)
    expert_inter = c.moe_intermediate_size
    span = FULL if rate else LINEAR
    return LayerShape(attention, 0, 3 * hidden * expert_inter, 3 * hidden * expert_inter, hidden * experts, 1,
                      -(-(head_dim + index_dim) // rate) if rate else 0, False, span, None, 0, state)


def _attention(c, hidden: int, heads: int, head_dim: int) -> tuple[int, int, int, bool]:
    """(parameters, KV heads stored, K+V channels per head, split by attention TP)."""
    kv_lora = getattr(c, "kv_lora_rank", None)
    if kv_lora:   # MLA
        nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q_lora = getattr(c, "q_lora_rank", None)
        q = hidden * q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
        kv = hidden * (kv_lora + rope) + kv_lora * heads * (nope + v)
        return q + kv + heads * v * hidden, 1, kv_lora + rope, False
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    params = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return params, kv_heads, 2 * head_dim, True


def _has_indexer(c, i: int) -> bool:
    """Whether layer i runs a lightning indexer (DeepSeek-V3.2: every layer; GLM-5: its "full" ones, as
    `indexer_types` lists them or, in a config.json without the list, as transformers derives them: an "F"/"S"
    `index_topk_pattern`, else every `index_topk_freq`-th layer from `index_skip_topk_offset` - 1 on)."""
    if not getattr(c, "index_topk", None):
        return False
    kinds = getattr(c, "indexer_types", None)
    if kinds is not None:
        return kinds[i] != "shared"
    pattern = getattr(c, "index_topk_pattern", None)
    if pattern is not None:
        return pattern[i] in ("F", "full")
    freq, offset = max(getattr(c, "index_topk_freq", 1) or 1, 1), getattr(c, "index_skip_topk_offset", 2)
    return max(i - offset + 1, 0) % freq == 0


def _indexer_params(c, hidden: int) -> int:
    """wq_b, wk, k_norm (weight and bias) and weights_proj (moe_runtime/layers/lightning_indexer.py)."""
    heads, dim = c.index_n_heads, c.index_head_dim
    return c.q_lora_rank * heads * dim + hidden * dim + 2 * dim + hidden * heads


def _linear_attention(c, hidden: int) -> tuple[int, int, int]:
    """A Gated DeltaNet layer (Qwen3-Next's config names): (parameters, float32 state, conv state) per sequence,
    as moe_runtime/layers/state_cache.py keeps them: [heads, Dk, Dv] float32 and [q+k+v channels, K-1]."""
    v_heads = getattr(c, "linear_num_value_heads", None) or c.num_attention_heads
    k_heads = getattr(c, "linear_num_key_heads", None) or v_heads
    dk, dv = getattr(c, "linear_key_head_dim", 128), getattr(c, "linear_value_head_dim", 128)
    key, value = k_heads * dk, v_heads * dv
    params = hidden * (2 * key + 2 * value + 2 * v_heads) + value * hidden
    conv = (2 * key + value) * (getattr(c, "linear_conv_kernel_dim", 4) - 1)
    return params, v_heads * dk * dv, conv


def _span(c, i: int) -> tuple[str, int | None]:
    """The layer's attention span, by moe_runtime/models/attention_spans.py's rule, plus linear attention."""
    layer_types = getattr(c, "layer_types", None)
    kind = layer_types[i] if layer_types else None
    if kind == "linear_attention":
        return LINEAR, None
    if kind == "chunked_attention":
        return CHUNKED, c.attention_chunk_size
    window = getattr(c, "sliding_window", None)
    if window is None:
        return FULL, None
    if layer_types is not None:
        return (SLIDING, window) if kind == "sliding_attention" else (FULL, None)
    if getattr(c, "use_sliding_window", True) is False:
        return FULL, None
    return SLIDING, window


def _is_moe_layer(c, architecture: str, i: int) -> bool:
    if architecture in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM") and getattr(c, "mlp_layer_types", None):
        return c.mlp_layer_types[i] == "sparse"
    if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM",
                        "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV4ForCausalLM"):
        return i >= (getattr(c, "first_k_dense_replace", 0) or 0)
    if architecture in QWEN_SPARSE:
        step = getattr(c, "decoder_sparse_step", 1) or 1
        return i not in (getattr(c, "mlp_only_layers", None) or []) and (i + 1) % step == 0
    if architecture == "Llama4ForCausalLM":
        moe_layers = getattr(c, "moe_layers", None)
        if moe_layers is None:
            step = getattr(c, "interleave_moe_layer_step", 1) or 1
            moe_layers = range(step - 1, c.num_hidden_layers, step)
        return i in moe_layers
    return True


def _shared_intermediate(c, architecture: str, expert_inter: int) -> int:
    if architecture in QWEN_SPARSE:
        return getattr(c, "shared_expert_intermediate_size", 0) or 0
    if architecture == "Llama4ForCausalLM":
        return expert_inter   # one shared expert of the routed experts' size
    return (getattr(c, "n_shared_experts", 0) or 0) * expert_inter
