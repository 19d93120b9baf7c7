"""The tiny architectures the tests build checkpoints of: each one's transformers config class and the config
arguments that make it small (tests/tiny_checkpoints.py builds and saves them)."""

from __future__ import annotations

from dataclasses import dataclass, field

TINY_INIT_STD = 0.1  # weight std; large enough that greedy argmax margins are not razor-thin

# Shared by all archs; each arch may override.
COMMON = dict(
    hidden_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=TINY_INIT_STD,
    tie_word_embeddings=False,
    hidden_act="silu",
)
_GQA = dict(num_attention_heads=8, num_key_value_heads=4)
_MLA = dict(  # DeepSeek multi-head latent attention; num_key_value_heads == num_attention_heads
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
_DEEPSEEK_V2 = dict(  # shared by the V2 and V2-Lite tiny models, which differ only in q_lora_rank
    **_MLA,
    num_hidden_layers=3,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    topk_method="group_limited_greedy",
    routed_scaling_factor=2.0,
    first_k_dense_replace=1,
)

_QWEN3_NEXT = dict(  # Qwen3-Next / Qwen3.5-MoE: three Gated DeltaNet layers, then one gated full attention
    **_GQA,
    num_hidden_layers=4,
    head_dim=32,
    linear_num_key_heads=4,       # every parallel layout of the registry splits whole key heads
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25),
)

_V3_ROUTING = dict(  # DeepSeek-V3's router and MoE layout, which GLM-4.5 shares
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
)


_SPARSE_INDEXER = dict(  # DeepSeek Sparse Attention's indexer: top-8 of prompts several times longer
    index_topk=8,
    index_head_dim=32,
    index_n_heads=16,   # many heads: a key that every head's ReLU zeroes (an exact tie) is rare
)

@dataclass(frozen=True)
class TinyArch:
    """A registry entry: the transformers config class and the config arguments of a tiny model."""

    name: str
    config_class: str  # attribute of the `transformers` package
    config: dict = field(default_factory=dict)
    notes: str = ""


TINY_ARCHS: dict[str, TinyArch] = {
    arch.name: arch
    for arch in (
        TinyArch(
            "llama",
            "LlamaConfig",
            dict(**_GQA, intermediate_size=256),
            "dense, GQA 8/4",
        ),
        TinyArch(
            "qwen2",
            "Qwen2Config",
            dict(**_GQA, intermediate_size=256, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
            "dense, qkv bias, tied embeddings, rope_theta 1e6",
        ),
        TinyArch(
            "mistral",
            "MistralConfig",
            dict(**_GQA, head_dim=32, intermediate_size=256, sliding_window=None),
            "dense, explicit head_dim 32 != hidden/heads, no sliding window",
        ),
        TinyArch(
            "mixtral",
            "MixtralConfig",
            dict(**_GQA, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
            "8 experts top-2, softmax then renormalised top-k",
        ),
        TinyArch(
            "qwen2_moe",
            "Qwen2MoeConfig",
            dict(
                **_GQA,
                num_hidden_layers=3,
                intermediate_size=256,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=128,
                num_experts=8,
                num_experts_per_tok=4,
                norm_topk_prob=False,
                mlp_only_layers=[1],
                decoder_sparse_step=1,
            ),
            "8 experts top-4 (not renormalised), shared expert with sigmoid gate, layer 1 dense, qkv bias",
        ),
        TinyArch(
            "qwen3_moe",
            "Qwen3MoeConfig",
            dict(
                **_GQA,
                head_dim=32,
                intermediate_size=256,
                moe_intermediate_size=64,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
            ),
            "8 experts top-2 renormalised, per-head q/k RMSNorm, head_dim 32 != hidden/heads",
        ),
        TinyArch(
            "olmoe",
            "OlmoeConfig",
            dict(
                num_attention_heads=8,
                num_key_value_heads=8,
                intermediate_size=64,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=False,
            ),
            "8 experts top-2, q/k RMSNorm over the whole projection, MHA",
        ),
        TinyArch(
            "deepseek_v2",
            "DeepseekV2Config",
            dict(**_DEEPSEEK_V2, q_lora_rank=64),
            "MLA with q_lora, softmax group_limited_greedy (4 groups, 2 kept), scaling 2.0, layer 0 dense",
        ),
        TinyArch(
            "deepseek_v2_lite",
            "DeepseekV2Config",
            dict(**_DEEPSEEK_V2, q_lora_rank=None),
            "as deepseek_v2 but MLA without q_lora (q_proj), like DeepSeek-V2-Lite",
        ),
        TinyArch(
            "deepseek_v3",
            "DeepseekV3Config",
            dict(
                **_MLA,
                num_hidden_layers=3,
                q_lora_rank=64,
                intermediate_size=256,
                moe_intermediate_size=64,
                **_V3_ROUTING,
            ),
            "MLA, sigmoid grouped top-4 of 16 (4 groups, 2 kept) with nonzero correction bias, scaling 2.5",
        ),
        TinyArch(
            "deepseek_v32",
            "DeepseekV32Config",
            dict(**_MLA, num_hidden_layers=3, q_lora_rank=64, intermediate_size=256, moe_intermediate_size=64,
                 **_V3_ROUTING, **_SPARSE_INDEXER),
            "DeepSeek-V3.2: DeepSeek-V3's MLA and routing, each layer's lightning indexer (16 heads of 32, half-split "
            "rotary on 8) keeping the top 8 tokens per query",
        ),
        TinyArch(
            "glm_moe_dsa",
            "GlmMoeDsaConfig",
            dict(**{**_MLA, "v_head_dim": 24}, num_hidden_layers=3, q_lora_rank=64, intermediate_size=256,
                 moe_intermediate_size=64, **_V3_ROUTING, **_SPARSE_INDEXER,
                 indexer_types=["full", "full", "shared"]),
            "GLM-5: DeepSeek-V3.2's sparse attention with interleaved rotary in the indexer, v_head_dim 24 != "
            "qk_nope_head_dim 16, layer 2 reusing layer 1's top-k tokens (a shared indexer layer)",
        ),
        TinyArch(
            "glm4_moe",
            "Glm4MoeConfig",
            dict(
                **_GQA,
                num_hidden_layers=3,
                intermediate_size=256,
                moe_intermediate_size=64,
                **_V3_ROUTING,
                use_qk_norm=True,
                attention_bias=True,
                rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5),
            ),
            "GLM-4.5: GQA 8/4 with q/k/v bias, per-head q/k norm, rotary on half of each head; DeepSeek-V3 routing "
            "(sigmoid, 4 groups, 2 kept, correction bias, scaling 2.5), shared expert, layer 0 dense; "
            "config says num_nextn_predict_layers=1",
        ),
        TinyArch(
            "minimax_m2",
            "MiniMaxM2Config",
            dict(
                **_GQA,
                head_dim=32,
                rotary_dim=16,
                intermediate_size=64,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
            "MiniMax-M2: GQA 8/4, head_dim 32 with rotary on 16, q/k RMSNorm over the whole projection; sigmoid "
            "top-2 of 8 with correction bias (on the block), renormalised; w1/w3/w2 experts in block_sparse_moe",
        ),
        TinyArch(
            "gpt_oss",
            "GptOssConfig",
            dict(
                **_GQA,
                num_hidden_layers=4,
                head_dim=32,
                intermediate_size=64,   # a multiple of 32: MXFP4 blocks
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=10,
                layer_types=["sliding_attention", "full_attention"] * 2,
                swiglu_limit=1.5,       # not the default 7.0: it binds on about a fifth of these activations
                rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                     truncate=False, original_max_position_embeddings=128),
            ),
            "gpt-oss: GQA 8/4, head_dim 32, q/k/v/o bias, attention sinks, sliding window 10 / full alternating, "
            "YaRN (factor 4, untruncated); router with bias, softmax over top-2 of 8, clamped SwiGLU (limit 1.5) "
            "with expert biases",
        ),
        TinyArch(
            "llama4",
            "Llama4TextConfig",
            dict(
                **_GQA,
                num_hidden_layers=4,
                head_dim=16,
                intermediate_size=64,            # experts and the shared expert
                intermediate_size_mlp=128,       # the dense layers
                num_local_experts=8,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,     # layers 1 and 3 MoE, 0 and 2 dense
                no_rope_layers=[1, 1, 1, 0],     # layer 3 NoPE (full attention), the others rotary and chunked
                attention_chunk_size=8,
                use_qk_norm=True,
                attn_temperature_tuning=True,
                floor_scale=4,                   # the NoPE queries' temperature steps up every 4 positions
                attn_scale=0.5,
                rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=64),
            ),
            "Llama 4 text: GQA 8/4, chunked local attention (8) with interleaved llama3 rotary and weightless q/k "
            "norm on layers 0-2, layer 3 NoPE over the whole context with temperature tuning (floor 4); sigmoid "
            "top-1 of 8 scaling the expert's input, shared expert, MoE on layers 1 and 3, dense MLP (128) on 0 and 2",
        ),
        TinyArch(
            "deepseek_v4",
            "DeepseekV4Config",
            dict(
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=32,
                partial_rotary_factor=0.25,      # rotary on the last 8 channels of each head
                q_lora_rank=32,
                o_groups=2,
                o_lora_rank=24,
                moe_intermediate_size=64,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                routed_scaling_factor=1.5,
                layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
                mlp_layer_types=["hash_moe", "moe", "moe"],
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                sliding_window=8,
                index_topk=4,
                index_n_heads=16,   # many heads: an entry that every head's ReLU zeroes (an exact tie) is rare
                index_head_dim=16,
                swiglu_limit=1.5,   # not the default 10: it binds on some of these activations
                rope_theta=1e4,
                compress_rope_theta=4e4,
            ),
            "DeepSeek-V4: layer 0 CSA (entries of 4 tokens, overlapping windows, indexer keeping the top 4), layer "
            "1 HCA (entries of 16 tokens: shrunk from 128), layer 2 sliding only, all with an 8-token sliding "
            "window and sinks; 4 hyper-connection streams; layer 0 hash-routed, sqrtsoftplus top-2 of 8, clamped "
            "SwiGLU (limit 1.5), grouped output projection (2 groups of 24)",
        ),
        TinyArch(
            "qwen3_next",
            "Qwen3NextConfig",
            dict(
                **_QWEN3_NEXT,
                norm_topk_prob=True,
                mlp_only_layers=[1],          # one dense layer (a linear one), as the config allows
                intermediate_size=96,
            ),
            "Qwen3-Next: layers 0-2 Gated DeltaNet (4 key / 8 value heads of 16, conv 4, projections fused per key "
            "head), layer 3 gated full attention (GQA 8/4, head_dim 32, rotary on 8, (1 + w) q/k norm); softmax "
            "top-2 of 8 renormalised, sigmoid-gated shared expert; layer 1 dense",
        ),
        TinyArch(
            "qwen3_5_moe",
            "Qwen3_5MoeTextConfig",
            dict(**_QWEN3_NEXT),
            "Qwen3.5-MoE text: Qwen3-Next's hybrid layout with the linear layers' q/k/v, z, b, a projections apart; "
            "every layer MoE (top-2 of 8, always renormalised) with a gated shared expert",
        ),
    )
}

