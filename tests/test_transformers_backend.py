"""The transformers backend (moe_runtime/models/transformers_backend): transformers' own modeling code with our
paged attention and MoE executor plugged in gives transformers' greedy tokens.

Tiny configs built here (a few architectures have no entry in tiny_archs.py), each saved by transformers
(`save_pretrained` writes the checkpoint's own names: Mixtral-style per-expert tensors where a model keeps fused
stacks, which the loader must map back through transformers' conversion rules). Prompts are longer than every
sliding window and than one KV block, steps are chunked (16 tokens), and a repeated prompt hits the prefix cache.
Engines are module-scoped and built on first use.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_helpers import greedy, runtime_prefill_logits
from lazy_engines import engine_pool
from shared_builds import build_once, shared_root
from tiny_checkpoints import HFOracle, build_model
from transformers_backend_cases import CHUNKED, NEW_TOKENS, PROMPTS, SMALL as BASE_SHAPE
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.errors import CheckpointError, InvalidRequestError, UnsupportedArchitectureError
from moe_runtime.weights.quantization.int8_in_memory import quantize_int8_rows

SMALL = dict(BASE_SHAPE, num_hidden_layers=2)


def _config(name: str):
    """The transformers config of each tiny model here (one concept per entry: what it exercises)."""
    import transformers as t

    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2)
    return {
        # layer 1 slides (window 8), layer 0 is full: two KV cache groups
        "qwen3": lambda: t.Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        # an architecture with no native port: shared experts, grouped routing, first layer dense
        # attention and final-logit soft-capping, alternating sliding (8) and full layers, scaled embeddings
        "gemma2": lambda: t.Gemma2Config(**SMALL, sliding_window=8, attn_logit_softcapping=20.0,
                                         final_logit_softcapping=15.0, query_pre_attn_scalar=24),
        # one full layer after five sliding ones (window 8), per-layer-type rotary bases, q/k norms
        "gemma3_text": lambda: t.Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 3}, sliding_window=8,
                                                  layer_types=["sliding_attention", "full_attention",
                                                               "sliding_attention"]),
        # fused qkv_proj and gate_up_proj in the model itself
        "phi3": lambda: t.Phi3Config(**SMALL),
        # KV heads kept in attn_config (kv_n_heads 2 of 4), not num_key_value_heads: the probe reads the module's
        "dbrx": lambda: t.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, vocab_size=512,
                                     attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                                     ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2),
                                     tie_word_embeddings=False, initializer_range=0.05, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2),
        # no native port: experts stacks with the text/vision split transformers' conversion rules undo
        "ernie4_5_moe": lambda: t.Ernie4_5_MoeConfig(**SMALL, **moe, moe_num_experts=8, moe_layer_start_index=1,
                                                     moe_num_shared_experts=1, use_bias=False),
        # Glm4MoeForCausalLM's code under sarvam_moe's checkpoint names (query_key_value, dense, word_embeddings)
        "sarvam_moe": lambda: t.SarvamMoEConfig(**SMALL, **moe, n_routed_experts=8, first_k_dense_replace=1),
        "dots1": lambda: t.Dots1Config(**{**SMALL, "num_hidden_layers": 3}, **moe, n_routed_experts=8,
                                       n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                       norm_topk_prob=True, routed_scaling_factor=1.5, sliding_window=None),
    }[name]()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir, tiny_checkpoint_factory):
    """`checkpoint(name) -> Path`, each built once per run: "tiny:<arch>" is tiny_archs.py's checkpoint."""
    def build(name: str, path):
        build_model(_config(name)).save_pretrained(str(path), safe_serialization=True)
        for file in sorted(tiny_tokenizer_dir.iterdir()):
            if file.is_file():
                shutil.copyfile(file, path / file.name)

    def get(name: str):
        if name.startswith("tiny:"):
            return tiny_checkpoint_factory(name.removeprefix("tiny:"))
        return build_once(shared_root(tmp_path_factory), f"transformers backend {name}", lambda path: build(name, path))
    return get


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(name, layout) -> its LLM through the transformers backend."""
    layouts = {"chunked": CHUNKED, "ep2_dp2": dict(ep=2, dp_attn=2), "native": dict(CHUNKED, model_impl="native"),
               "auto": dict(CHUNKED, model_impl="auto")}
    with engine_pool(lambda name, layout: LLM(str(checkpoint(name)), device="cpu", dtype="float32",
                                              **{"model_impl": "transformers", **layouts[layout]})) as get:
        yield get


def _expected(checkpoint, name: str) -> list[list[int]]:
    return HFOracle(checkpoint(name)).greedy(PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3_text", "phi3", "dots1", "tiny:mixtral"])
def test_greedy_tokens_match_transformers_with_chunks_and_prefix_cache(engines, checkpoint, name):
    llm = engines(name, "chunked")
    expected = _expected(checkpoint, name)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
    [again] = llm.generate([PROMPTS[0]], greedy(NEW_TOKENS))   # its first two blocks come from the prefix cache
    assert again.token_ids == expected[0]


@pytest.mark.parametrize("name", ["ernie4_5_moe", "dbrx"])
def test_architecture_without_native_port(engines, checkpoint, name):
    llm = engines(name, "chunked")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == _expected(checkpoint, name)


def test_expert_parallel_with_dp_attention(engines, checkpoint):
    """EP 2 x DP attention 2: each rank holds 4 of the 8 experts; tokens are dispatched to the rank holding theirs.
    A rank with no tokens runs a stand-in token through the layers' collectives (StepContext.stand_in)."""
    llm = engines("dots1", "ep2_dp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == _expected(checkpoint, "dots1")
    [alone] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))   # the other DP worker idles through each step
    assert alone.token_ids == _expected(checkpoint, "dots1")[1]
    load = llm.expert_load()   # recorded by the executor: the two MoE layers' routing went through it
    assert tuple(load.counts.shape) == (2, 8) and load.counts.sum() > 0


def test_forced_generic_path_matches_the_native_port(engines, checkpoint):
    """Qwen3-MoE has a native port: `--model-impl transformers` gives the same prompt logits and tokens."""
    generic, native = engines("tiny:qwen3_moe", "chunked"), engines("tiny:qwen3_moe", "native")
    assert type(generic.core.model).__name__ == "TransformersCausalLM"
    assert type(native.core.model).__name__ == "CausalLM"
    torch.testing.assert_close(runtime_prefill_logits(generic.core, PROMPTS[0]),
                               runtime_prefill_logits(native.core, PROMPTS[0]), rtol=1e-4, atol=1e-4)
    expected = _expected(checkpoint, "tiny:qwen3_moe")
    assert [o.token_ids for o in generic.generate(PROMPTS, greedy(NEW_TOKENS))] == expected


def test_model_type_with_its_own_checkpoint_names_is_mapped(engines, checkpoint):
    """config.json: architectures Glm4MoeForCausalLM, model_type sarvam_moe, tensors under Sarvam's names. `auto`
    sends it to the transformers backend (the native GLM port reads GLM's names), whose conversion rules map them."""
    llm = engines("sarvam_moe", "auto")
    assert type(llm.core.model).__name__ == "TransformersCausalLM"
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == _expected(checkpoint, "sarvam_moe")


def test_tensors_of_another_model_are_refused_by_name(checkpoint, tmp_path):
    """The same tensors under a config that says glm4_moe: no rule maps them, and the first are named."""
    path = tmp_path / "sarvam_as_glm"
    shutil.copytree(checkpoint("sarvam_moe"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "glm4_moe"}))
    with pytest.raises(CheckpointError, match=r"map to no parameter.*'model\.layers\.0\.attention\.dense\.weight'"):
        LLM(str(path), device="cpu", dtype="float32", model_impl="transformers")


def test_routing_replay_is_refused_for_transformers_routers(engines):
    """transformers' routers compute the top-k inside its code: recording or forcing it is refused per request."""
    with pytest.raises(InvalidRequestError, match="return_routed_experts.*transformers' own code"):
        engines("dots1", "chunked").generate([PROMPTS[2]], greedy(2, return_routed_experts=True))


def test_what_the_backend_cannot_run_is_refused_by_name(checkpoint, tiny_checkpoint_factory):
    """Refused at the front, before any weight is read, naming each flag or module."""
    with pytest.raises(EngineConfigError, match="--model-impl 'tranformers': choose one of auto, native, transformers"):
        LLM(str(checkpoint("qwen3")), device="cpu", model_impl="tranformers")
    with pytest.raises(UnsupportedArchitectureError, match="Llama4TextAttention's query temperature"):
        LLM(str(tiny_checkpoint_factory("llama4")), device="cpu", model_impl="transformers")
    with pytest.raises(EngineConfigError, match=r"transformers backend \(Qwen3ForCausalLM\).*--deterministic"):
        LLM(str(checkpoint("qwen3")), device="cpu", model_impl="transformers", deterministic=True)


def test_weight_update_reaches_the_transformers_model(tiny_checkpoint_factory):
    """A full update from another checkpoint is loaded through transformers' rules again (experts taken anew,
    rotary frequencies kept): the tokens are the new checkpoint's."""
    first, second = tiny_checkpoint_factory("qwen3_moe"), tiny_checkpoint_factory("qwen3_moe", seed=1)
    llm = LLM(str(first), device="cpu", dtype="float32", model_impl="transformers")
    try:
        llm.update_weights(str(second))
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == \
            HFOracle(second).greedy(PROMPTS, NEW_TOKENS)
    finally:
        llm.shutdown()


def test_int8_experts_are_kept_int8_and_give_transformers_tokens_on_their_dequantized_weights(checkpoint):
    """--quantization int8 on the generic path: the routed experts are quantized per output row into our stacks (the
    rest stays in --dtype); the oracle is transformers with each expert's weights replaced by those int8 rows
    dequantized, so the tokens must be equal."""
    llm = LLM(str(checkpoint("dots1")), device="cpu", dtype="float32", model_impl="transformers",
              quantization="int8", **CHUNKED)
    stacks = list(llm.core.model.routed_experts)
    assert stacks and all(w.w13.dtype == torch.int8 and w.w2.dtype == torch.int8 for w in stacks)
    oracle = HFOracle(checkpoint("dots1"))
    with torch.no_grad():
        for module in oracle.model.modules():
            if not hasattr(module, "gate_up_proj") or not hasattr(module, "is_transposed"):
                continue
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(module, name)                                   # [E, out, in] (transposed: [E, in, out])
                rows = weight.transpose(1, 2) if module.is_transposed else weight
                q = quantize_int8_rows(rows)
                dequantized = q.values.float() * q.scales.unsqueeze(-1)
                weight.copy_(dequantized.transpose(1, 2) if module.is_transposed else dequantized)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == oracle.greedy(PROMPTS, NEW_TOKENS)
    finally:
        llm.shutdown()


def test_replicas_and_a_live_rebalance_serve_the_generic_path(checkpoint):
    """EP 2 x DP attention 2 with two redundant expert slots: the executor's placement holds replicas of the
    transformers model's experts, and a rebalance that moves them keeps transformers' tokens."""
    expected = _expected(checkpoint, "tiny:qwen3_moe")
    with LLM(str(checkpoint("tiny:qwen3_moe")), device="cpu", dtype="float32", model_impl="transformers", ep=2,
             dp_attn=2, num_redundant_experts=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        event = llm.rebalance_now()
        assert event.ok and event.experts_moved > 0, event
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected


def test_host_experts_serve_the_generic_path(checkpoint):
    """--cpu-experts: the transformers model's routed experts run on the host kernels beside its shared ones."""
    with LLM(str(checkpoint("tiny:qwen3_moe")), device="cpu", dtype="float32", model_impl="transformers",
             cpu_experts=True) as llm:
        assert llm.core.model.executor.host_kernel is not None
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == \
            _expected(checkpoint, "tiny:qwen3_moe")
