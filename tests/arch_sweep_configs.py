"""Tiny configs of every causal-LM architecture transformers ships with experts, and a few dense families.

`sweep_model_types()` lists the model types of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES whose default config names experts
(a key containing "expert"; DBRX keeps them in `ffn_config`), plus DENSE_TYPES. `tiny_config(model_type, tokenizer)`
shrinks the default config generically: every size key it knows (SIZES) gets a small value, the experts become 8,
top-2, groups that fit; the layers become the fewest that still hold one layer of every kind the config tells apart
(per-layer lists such as layer_types, index lists such as mlp_only_layers, first_k_dense_replace); windows, chunks and
top-k of sparse attention become smaller than the sweep's prompt. OVERRIDES holds what a config needs beyond that, one
line each with why.
"""
from __future__ import annotations

DENSE_TYPES = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "phi3")
WINDOW = 8            # sliding windows, attention chunks, sparse top-k: the sweep's prompts are several times longer
HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
EXPERTS = 8
TOP_K = 2
# weight std (tiny_checkpoints.build_model randomizes with the config's initializer_range): at 0.1 a tenth of these
# models repeat one or two tokens greedily (a weak oracle), at 0.2 two of 71 do; wide argmax margins besides
INIT_STD = 0.2

# key -> tiny value, applied where the default config has the key set (not None)
SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN,
    "num_attention_heads": HEADS, "n_heads": HEADS, "swa_num_attention_heads": HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "swa_head_dim": HEAD_DIM, "rotary_dim": HEAD_DIM // 2,
    "intermediate_size": 96, "ffn_hidden_size": 96, "intermediate_size_mlp": 96, "dense_intermediate_size": 96,
    "first_dense_intermediate_size": 96, "mlp_only_intermediate_size": 96,
    "moe_intermediate_size": 32, "expert_ffn_hidden_size": 32, "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_k": TOP_K, "moe_topk": TOP_K,
    "top_k_experts": TOP_K,
    "kv_lora_rank": 32, "q_lora_rank": 32, "o_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "qk_head_dim": 24, "v_head_dim": 16,
    "index_topk": WINDOW, "index_head_dim": 16, "index_n_heads": HEADS, "index_num_heads": HEADS,
    "index_topk_blocks": 2, "index_block_size": 4, "index_num_local_tokens": 4, "index_num_sink_tokens": 2,
    "index_pool_size": 64, "index_compression": 2,
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_chunk_size": WINDOW, "keep_window_size": WINDOW,
    "rel_extent": WINDOW,
    "max_position_embeddings": 512, "max_seq_len": 512, "model_max_length": 512,
    "original_max_position_embeddings": 128,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": HEADS, "linear_head_dim": 16, "block_size": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": WINDOW, "mamba_dt_rank": 8,
    "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "chunk_size": WINDOW, "n_groups": 1,
    "hc_lowrank": 8, "ple_embed_dim": 16, "loop_gate_rank": 8, "gated_norm_rank": 4, "router_hidden_size": 16,
    "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 512,
}
# set even where the default leaves them None (a config whose default is dense until told its experts)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERT_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts")
GROUPS = ("n_group", "num_expert_group")        # 4 groups of 2 experts when the default groups at all
TOPK_GROUPS = ("topk_group",)                # ... of which 2 are kept: top-2 always fits
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
KV_HEADS = ("num_key_value_heads", "swa_num_key_value_heads")
# per-layer index lists ([i, j, ...] of layer numbers): remapped to the kept layers
LAYER_INDEX_LISTS = ("mlp_only_layers", "moe_layers", "index_layers", "ple_layer_ids")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layers", "num_layers")
MAX_LAYERS = 6

# model type -> config arguments the generic shrinking does not give it; one line each, with why
OVERRIDES: dict[str, dict] = {
    "llama4_text": dict(num_hidden_layers=4, moe_layers=[1, 3], no_rope_layers=[1, 1, 1, 0],   # layer 3 NoPE, global
                        layer_types=["chunked_attention"] * 3 + ["full_attention"], interleave_moe_layer_step=2,
                        num_experts_per_tok=1),   # Llama 4 routes top-1 (its sigmoid score scales the expert's input)
    "gemma3_text": dict(sliding_window_pattern=2, query_pre_attn_scalar=HEAD_DIM),  # a global layer within 2 layers
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),  # 2 layers
    "afmoe": dict(global_attn_every_n_layers=2, num_dense_layers=1),   # dense, sliding and global layers in 3
    "ergo": dict(global_attention_every_n_layers=2, num_dense_blocks=1),   # dense, sliding and global layers in 3
    "cohere2_moe": dict(sliding_window_pattern=2, prefix_dense_sliding_window_pattern=1),   # both attentions in 3
    "ernie4_5_moe": dict(moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1),   # dense then MoE
    "minimax": dict(block_size=4),      # lightning attention blocks smaller than the prompt
    "lfm2_moe": dict(num_hidden_layers=3, num_dense_layers=1,   # default layer_types is None: conv and attention
                     layer_types=["conv", "full_attention", "conv"]),
    "qwen4_exp_text": dict(indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=16,   # QSA on, small top-k
                           indexer_budget=WINDOW, indexer_compress_ratio=2),
    "deepseek_v4": dict(num_hidden_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"],   # every attention kind
                        layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                                     "sliding_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                        head_dim=32, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=24),   # as tiny_archs.py
    "dots3_note_text": dict(head_dim=24, swa_num_attention_heads=HEADS, swa_num_key_value_heads=HEADS,   # its SWA
                            swa_q_lora_rank=32, swa_kv_lora_rank=32, swa_head_dim=24, swa_qk_nope_head_dim=16,
                            swa_v_head_dim=16),   # layers' own MLA sizes (per_layer_config) are kwargs, not keys
    "gemma4_text": dict(global_head_dim=32),   # the global layers' head_dim is a kwarg (512), not a key
    "laguna": dict(num_attention_heads_per_layer=[HEADS, HEADS]),   # one head count per (kept) layer
    "inkling2_text": dict(n_layers_per_attn_res_block=1),   # blocks of one layer: 2 layers cross a block edge
    "inkling2_loop_text": dict(n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
                               loop_num_passes=2),   # the looped layer within the 2 layers
    "zaya": dict(num_experts_per_tok=1,   # the config refuses any other top-k
                 initializer_range=0.4),  # at 0.2 it continues every prompt with one repeated token
    "granitemoehybrid": dict(mamba_d_head=2 * HIDDEN // 4,   # mamba heads x head dim = mamba_expand x hidden
                             layer_types=["linear_attention", "full_attention"]),  # default: Mamba layers only
    "kolibri1_1": dict(num_hidden_layers=4, mlp_only_layers=[0], index_layers=[2], kv_source_layers=[0, 1, 2, 2],
                       layer_types=["sliding_attention"] * 2 + ["indexed_attention"] * 2,   # KV shared by layer 3
                       index_num_heads=2),   # at most the query heads of one key head
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),   # heads and experts in sub-configs;
                 ffn_config=dict(hidden_size=HIDDEN, ffn_hidden_size=32, moe_num_experts=EXPERTS,   # clip_qkv None
                                 moe_top_k=TOP_K)),   # fails: its attention clamps whatever the config says
}


def sweep_model_types() -> list[str]:
    """Every causal-LM model type with experts in its default config, then the dense families."""
    found = [t for t, keys in _default_configs()[0].items() if t == "dbrx" or any("expert" in k for k in keys)]
    return found + [t for t in DENSE_TYPES if t not in found]


def unreadable_model_types() -> dict[str, str]:
    """Causal-LM model types whose default config transformers itself cannot build (so none to shrink): the reason."""
    return _default_configs()[1]


def _default_configs() -> tuple[dict[str, dict], dict[str, str]]:
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    configs, failures = {}, {}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            try:
                configs[model_type] = AutoConfig.for_model(model_type).to_dict()
            except Exception as error:  # noqa: BLE001 - whatever transformers raises is the reason to record
                failures[model_type] = f"{type(error).__name__}: {' '.join(str(error).split())}"
    finally:
        transformers.logging.set_verbosity(verbosity)
    return configs, failures


def _kept_layers(default: dict, num_layers: int) -> list[int]:
    """The fewest layer numbers that hold one layer of every kind: first occurrences of each distinct tuple of
    per-layer values (every list of length num_layers, membership of each index list, first-k-dense)."""
    per_layer = [v for k, v in sorted(default.items()) if isinstance(v, list) and len(v) == num_layers]
    index_lists = [set(default[k]) for k in LAYER_INDEX_LISTS if isinstance(default.get(k), list)]
    first_dense = default.get("first_k_dense_replace") or 0
    kept, seen = [], set()
    for layer in range(num_layers):
        kind = (tuple(str(values[layer]) for values in per_layer), tuple(layer in s for s in index_lists),
                layer < first_dense)
        if kind not in seen:
            seen.add(kind)
            kept.append(layer)
    if len(kept) < 2 and num_layers >= 2:
        kept.append(1 if kept == [0] else 0)
    return sorted(kept)[:MAX_LAYERS]


def tiny_config_kwargs(model_type: str, default: dict, vocab_size: int, special_ids: dict) -> dict:
    """The config arguments that make `model_type`'s default config (`default`, its to_dict()) tiny."""
    kwargs: dict = {}
    for key, value in SIZES.items():
        if default.get(key) is not None and not isinstance(default[key], (list, dict, bool)):
            kwargs[key] = value
    heads = default.get("num_attention_heads") or default.get("n_heads")
    for key in KV_HEADS:
        if isinstance(default.get(key), int):   # MHA stays MHA, MQA stays MQA, GQA becomes 4/2
            kwargs[key] = HEADS if default[key] == heads else (1 if default[key] == 1 else 2)
    for key in GROUPS:
        if isinstance(default.get(key), int) and default[key] > 1:
            kwargs[key] = 4
    for key in TOPK_GROUPS:
        if isinstance(default.get(key), int) and default[key] > 1:
            kwargs[key] = 2
    for key in SHARED_EXPERTS:
        if key in default and (default[key] is None or default[key] > 1):
            kwargs[key] = 1
    for key in EXPERT_COUNTS + EXPERT_TOP_K:
        if key in default and not isinstance(default[key], (list, dict)):
            kwargs[key] = EXPERTS if key in EXPERT_COUNTS else TOP_K
    if "head_dim" in default:   # where it is None the model reads it anyway (hunyuan); MLA: it is the rope part
        kwargs["head_dim"] = SIZES["qk_rope_head_dim"] if default.get("qk_rope_head_dim") else HEAD_DIM
    for key in ("vocab_size", "unpadded_vocab_size"):
        if default.get(key) is not None:
            kwargs[key] = vocab_size
    for key, value in special_ids.items():
        if key in default:
            kwargs[key] = value
    count_key = next((k for k in LAYER_COUNT_KEYS if isinstance(default.get(k), int)), None)
    if count_key is not None:
        num_layers = default[count_key]
        if "first_k_dense_replace" in default and (default["first_k_dense_replace"] or 0) > 0:
            kwargs["first_k_dense_replace"] = 1
            default = {**default, "first_k_dense_replace": 1}
        kept = _kept_layers(default, num_layers)
        kwargs[count_key] = len(kept)
        for key, value in default.items():
            if isinstance(value, list) and len(value) == num_layers and key not in LAYER_INDEX_LISTS:
                kwargs[key] = [value[i] for i in kept]
        for key in LAYER_INDEX_LISTS:
            if isinstance(default.get(key), list):
                kwargs[key] = [kept.index(i) for i in default[key] if i in kept]
    kwargs["initializer_range"] = INIT_STD
    kwargs.update(OVERRIDES.get(model_type, {}))
    kwargs["tie_word_embeddings"] = False if "tie_word_embeddings" in default else kwargs.get("tie_word_embeddings")
    return {k: v for k, v in kwargs.items() if v is not None or k in default}


def tiny_config(model_type: str, tokenizer):
    """`model_type`'s default transformers config made tiny (vocab and special ids from `tokenizer`)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    return AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, default, len(tokenizer), special))
