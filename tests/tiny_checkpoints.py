"""Tiny random HF checkpoints for every supported architecture, and the transformers oracle.

Each builder writes a standard HF directory (config.json, safetensors, generation_config.json,
tokenizer files) from a `transformers` model with deterministic random weights
(`moe_runtime.weights.random_weights`: norm weights around 1 and biases nonzero too, so a loader that
drops a norm or a bias cannot pass by accident; DeepSeek-V3's e_score_correction_bias is nonzero
so grouped routing really depends on it).

`HFOracle` (and the one-shot `hf_greedy`, `hf_prefill_logits`) is the oracle the runtime is held against (fp32, one prompt
at a time, no padding).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights
from moe_runtime.demo.tokenizer_training import TokenizerSpec, save_tokenizer, train_tokenizer

TINY_VOCAB_SIZE = 512
TINY_INIT_STD = 0.1  # weight std; large enough that greedy argmax margins are not razor-thin

# Shared by all archs; each arch may override.
_COMMON = dict(
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


def tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """A freshly trained small tokenizer (about 1-2 s); fixtures train it once per session."""
    return train_tokenizer(TokenizerSpec(vocab_size=vocab_size, model_max_length=_COMMON["max_position_embeddings"]))


def tiny_config(arch: str, tokenizer, **overrides):
    """The transformers config of the tiny `arch` model, its vocab and special ids from `tokenizer`."""
    import transformers

    spec = _arch_spec(arch)
    kwargs = {**_COMMON, **spec.config}
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    return getattr(transformers, spec.config_class)(**kwargs)


def build_model(config, seed: int = 0):
    """A transformers causal LM for `config`, fp32, eval mode, randomized with `seed`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed, RandomWeightScales(matrix_std=config.initializer_range))
    return model.eval()


def build_tiny_checkpoint(
    arch: str,
    path: str | Path,
    *,
    tokenizer=None,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides,
) -> Path:
    """Write a tiny random `arch` checkpoint (fp32 safetensors + tokenizer) into `path`.

    `tokenizer`: a tokenizer object or a saved tokenizer directory; None trains one (slower).
    `max_shard_size`: passed to `save_pretrained` to write a sharded checkpoint with an index.
    `overrides`: config arguments replacing the registry's (e.g. num_hidden_layers=4).
    """
    _arch_spec(arch)  # fail on a bad name before training a tokenizer
    path = Path(path)
    tokenizer_dir = Path(tokenizer) if isinstance(tokenizer, (str, Path)) else None
    tokenizer = _as_tokenizer(tokenizer)
    model = build_model(tiny_config(arch, tokenizer, **overrides), seed=seed)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), safe_serialization=True, **save_kwargs)
    if tokenizer_dir is None:
        save_tokenizer(tokenizer, path)
    else:  # copy the files as saved: re-saving a loaded tokenizer adds loader arguments to its config
        for file in sorted(tokenizer_dir.iterdir()):
            if file.is_file():
                shutil.copyfile(file, path / file.name)
    return path


def build_sharded_tiny_checkpoint(arch: str, path: str | Path, *, num_shards: int = 3, **kwargs) -> Path:
    """`build_tiny_checkpoint` split into about `num_shards` (>= 2) safetensors files with an index."""
    if num_shards < 2:
        raise ValueError(f"num_shards={num_shards}: a sharded checkpoint needs at least 2")
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        tokenizer = tiny_tokenizer()
    overrides = {k: v for k, v in kwargs.items() if k != "seed"}
    config = tiny_config(arch, _as_tokenizer(tokenizer), **overrides)
    total_bytes = _fp32_model_bytes(config)
    shard_bytes = max(1, math.ceil(total_bytes / num_shards))
    out = build_tiny_checkpoint(arch, path, tokenizer=tokenizer, max_shard_size=shard_bytes, **kwargs)
    if not (out / "model.safetensors.index.json").exists():
        raise RuntimeError(f"save_pretrained wrote no shard index into {out}")
    return out


class TinyCheckpointFactory:
    """Builds each (arch, options) checkpoint once under `root` and hands back its path.

    `factory("deepseek_v3")`, `factory("llama", sharded=True)`, `factory("mixtral", num_hidden_layers=3)`.
    """

    def __init__(self, root: str | Path, tokenizer_dir: str | Path):
        self.root = Path(root)
        self.tokenizer_dir = Path(tokenizer_dir)
        self._built: dict[str, Path] = {}

    def __call__(self, arch: str, *, sharded: bool = False, seed: int = 0, **overrides) -> Path:
        key = repr((arch, sharded, seed, sorted(overrides.items())))
        if key not in self._built:
            path = self.root / f"{arch}-{len(self._built)}"
            builder = build_sharded_tiny_checkpoint if sharded else build_tiny_checkpoint
            self._built[key] = builder(arch, path, tokenizer=self.tokenizer_dir, seed=seed, **overrides)
        return self._built[key]


class HFOracle:
    """A checkpoint loaded once in transformers (fp32, eval): the reference the runtime must match."""

    def __init__(self, path: str | Path):
        from transformers import AutoModelForCausalLM

        self.path = Path(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, local_files_only=True
        ).eval()

    def greedy(self, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation (new tokens only) of each prompt, eos ignored.

        Each prompt runs alone (no padding) and no stop token is set, so every result has exactly
        `max_new_tokens` ids: the exact oracle for a runtime run with ignore_eos.
        """
        from transformers import GenerationConfig

        generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=self.model.config.pad_token_id,
            bos_token_id=self.model.config.bos_token_id,
        )
        results: list[list[int]] = []
        with torch.no_grad():
            for index, ids in enumerate(prompts_token_ids):
                if len(ids) == 0:
                    raise ValueError(f"prompts_token_ids[{index}] is empty")
                input_ids = torch.tensor([list(ids)], dtype=torch.long)  # [1, T]
                out = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
                )  # [1, T + max_new_tokens]
                new_tokens = out[0, input_ids.shape[1] :].tolist()
                if len(new_tokens) != max_new_tokens:
                    raise RuntimeError(f"transformers generated {len(new_tokens)} tokens, wanted {max_new_tokens}")
                results.append(new_tokens)
        return results

    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits `[T, V]` at every position of one prompt, one forward without cache."""
        if len(token_ids) == 0:
            raise ValueError("token_ids is empty")
        with torch.no_grad():
            input_ids = torch.tensor([list(token_ids)], dtype=torch.long)  # [1, T]
            logits = self.model(input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
        return logits[0].float()  # [T, V]


class GreedyOracle:
    """transformers' greedy continuations of tiny checkpoints, each (arch, prompt) computed once per session.

    Greedy decoding with eos ignored is deterministic, so the first n tokens of a longer continuation
    are the n-token continuation: a test asking for fewer tokens is answered from a longer run.
    """

    def __init__(self, factory: "TinyCheckpointFactory"):
        self._factory = factory
        self._tokens: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def __call__(self, arch: str, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        keys = [(arch, tuple(ids)) for ids in prompts_token_ids]
        missing = list(dict.fromkeys(k for k in keys if len(self._tokens.get(k, ())) < max_new_tokens))
        if missing:
            found = HFOracle(self._factory(arch)).greedy([list(ids) for _, ids in missing], max_new_tokens)
            self._tokens.update(zip(missing, found))
        return [self._tokens[key][:max_new_tokens] for key in keys]


def hf_greedy(path: str | Path, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation (new tokens only) of each prompt: see `HFOracle.greedy`."""
    return HFOracle(path).greedy(prompts_token_ids, max_new_tokens)


def hf_prefill_logits(path: str | Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits `[T, V]` for every position of one prompt."""
    return HFOracle(path).prefill_logits(token_ids)


def _arch_spec(arch: str) -> TinyArch:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_ARCHS)}")
    return TINY_ARCHS[arch]


def _as_tokenizer(tokenizer):
    if tokenizer is None:
        return tiny_tokenizer()
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def _fp32_model_bytes(config) -> int:
    """Bytes of the model's fp32 weights, built on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return sum(t.numel() * 4 for t in model.state_dict().values())
