"""gpt-oss (`GptOssForCausalLM`) gives transformers' greedy tokens and prompt logprobs on one rank, with EP + DP
attention, with attention TP (the sinks split with the heads), with PP, and with chunked prefill + prefix caching;
its sliding layers keep their own bounded KV cache group; an MXFP4 checkpoint in the published layout gives the
tokens of its dequantized twin, loaded dequantized and kept in MXFP4.

The tiny model (tests/tiny_checkpoints.py "gpt_oss"): four layers alternating sliding window 10 / full, YaRN
rotary, blocks of 4 tokens here, prompts up to four windows long and chunks of 12 tokens, so decode and chunked
prefill read across the window's edge and a sliding layer's blocks really leave it. Engines are built once per
module, on first use, and shared by the tests.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from lazy_engines import lazy_engines
from window_watch import window_blocks_held
from engine_helpers import greedy
from test_prompt_logprobs import assert_prompt_logprobs_match, expected_logprobs
from mxfp4_checkpoints import write_mxfp4_checkpoint
from tiny_checkpoints import TINY_ARCHS, HFOracle
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.layers.attention_span import SLIDING, AttentionSpan
from moe_runtime.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from moe_runtime.models.attention_spans import attention_spans
from moe_runtime.server.reasoning.selection import choose_reasoning

ARCH = "gpt_oss"
WINDOW, BLOCK = TINY_ARCHS[ARCH].config["sliding_window"], 4
HELD_BOUND = -(-WINDOW // BLOCK) + 1          # ceil(W / block_size) + 1
NEW_TOKENS = 8
LONG_TOKENS = 48                               # a generation several windows past the prompt
NUM_TOP = 3
PROMPTS = [  # all longer than the window, a chunk and a block
    [(7 * i + 3) % 500 + 5 for i in range(40)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(37)],
    [(13 * i + 4) % 470 + 6 for i in range(17)],
]
LAYOUTS = {   # name -> LLM options (every engine: fp32, blocks of 4)
    "one_rank": {},
    "chunked_prefix": dict(max_num_batched_tokens=12, enable_chunked_prefill=True, enable_prefix_caching=True),
    "ep2_dp2": dict(ep=2, dp_attn=2),
    "ep2_attention_tp2": dict(ep=2, dp_attn=1),   # one DP worker over two ranks: heads and sinks split in two
    "pp2": dict(pp=2),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(ARCH)


@pytest.fixture(scope="module")
def mxfp4_checkpoints(checkpoint, tmp_path_factory):
    """(twin, mxfp4): the experts rounded to MXFP4 values, written plain and in the published layout."""
    return write_mxfp4_checkpoint(checkpoint, tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.fixture(scope="module")
def engines(checkpoint):
    """layout -> its `LLM`, built on first use and shut down after the module."""
    with lazy_engines(checkpoint, LAYOUTS, device="cpu", dtype="float32", block_size=BLOCK) as get:
        yield get


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return HFOracle(checkpoint)


@pytest.fixture(scope="module")
def expected(greedy_oracle):
    tokens = greedy_oracle(ARCH, PROMPTS, NEW_TOKENS)
    assert any(len(set(t)) > 2 for t in tokens), "oracle output is degenerate; the test would be weak"
    return tokens


def tokens_of(llm: LLM, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, greedy(new_tokens))]


# ---------------------------------------------------------------------------------------- the pieces
@pytest.mark.parametrize("rope", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=True, original_max_position_embeddings=4096),
    dict(factor=8.0, attention_factor=0.9, original_max_position_embeddings=2048),
    dict(factor=16.0, mscale=1.0, mscale_all_dim=0.5, original_max_position_embeddings=1024),
], ids=["published", "truncated", "explicit_attention_factor", "mscale"])
def test_yarn_rotary_equals_transformers(rope):
    """YaRN's frequencies, attention factor and truncate flag, as transformers' gpt-oss rotary applies them."""
    config = GptOssConfig(head_dim=64, max_position_embeddings=131072,
                          rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, **rope))
    theirs = GptOssRotaryEmbedding(config)
    inv_freq, scaling = rope_inverse_frequencies(config, 64)
    assert scaling == theirs.attention_scaling != 1.0
    positions = torch.tensor([0, 1, 17, 4095, 4096, 100000])
    ours = RotaryEmbedding(inv_freq, scaling, interleaved=False)
    cos, sin = ours.cos_sin(positions, torch.float32)                                  # [T, 1, 32]
    want_cos, want_sin = theirs(torch.zeros(1), positions[None])                       # [1, T, 32]
    torch.testing.assert_close(cos[:, 0], want_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0], want_sin[0], rtol=0, atol=0)


def test_layer_spans_alternate_and_the_sliding_layers_get_their_own_group(checkpoint, engines):
    config = GptOssConfig.from_pretrained(checkpoint)
    assert attention_spans(config) == [AttentionSpan(SLIDING, WINDOW), AttentionSpan()] * 2
    core = engines("one_rank").core
    assert [w.span for w in core.block_manager.windows] == [AttentionSpan(SLIDING, WINDOW)]
    layers = core.model.model.layers
    assert [layer.self_attn.shape.span for layer in layers] == attention_spans(config)
    assert all(layer.self_attn.sinks is not None for layer in layers)
    assert choose_reasoning(None, json.loads((checkpoint / "config.json").read_text())["model_type"]).harmony


# ---------------------------------------------------------------------------------------- transformers parity
def test_one_rank_tokens_and_prompt_logprobs_equal_transformers(engines, expected, oracle):
    outputs = engines("one_rank").generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected
    for prompt, output in zip(PROMPTS, outputs):
        assert_prompt_logprobs_match(output.prompt_logprobs, expected_logprobs(oracle, prompt), prompt, NUM_TOP)


def test_a_long_generation_holds_at_most_its_window_in_the_sliding_group(engines, greedy_oracle):
    """Decoding far past the window: transformers' tokens, and the sliding group holds ceil(W / block) + 1
    blocks of the sequence at every step."""
    with window_blocks_held(engines("one_rank").core) as held:
        [out] = engines("one_rank").generate([PROMPTS[0]], greedy(LONG_TOKENS))
    assert out.token_ids == greedy_oracle(ARCH, [PROMPTS[0]], LONG_TOKENS)[0]
    decode_steps = held[-(LONG_TOKENS - 1):]
    assert len(held) >= LONG_TOKENS and max(decode_steps) <= HELD_BOUND, decode_steps


def test_chunked_prefill_and_prefix_caching_keep_the_tokens(engines, expected):
    llm = engines("chunked_prefix")
    assert tokens_of(llm) == expected
    hits = llm.engine.stats().prefix_cache_hits
    assert tokens_of(llm) == expected                   # every prompt again: prefix hits through the sliding group
    reusable = sum((len(prompt) - 1) // BLOCK * BLOCK for prompt in PROMPTS)   # all but the last token's block
    assert llm.engine.stats().prefix_cache_hits - hits >= reusable, "the repeated prompts did not reuse their blocks"


@pytest.mark.slow
def test_expert_parallel_with_dp_attention_matches(engines, expected):
    llm = engines("ep2_dp2")
    assert tokens_of(llm) == expected
    for rank, (local, total) in llm.engine.client.resident_expert_bytes().items():
        assert local * 2 == total, f"rank {rank} holds {local} of {total} routed-expert bytes"


@pytest.mark.slow
def test_attention_tensor_parallel_splits_the_sinks_with_the_heads(engines, expected, oracle):
    outputs = engines("ep2_attention_tp2").generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected
    prompt = PROMPTS[0]
    assert_prompt_logprobs_match(outputs[0].prompt_logprobs, expected_logprobs(oracle, prompt), prompt, NUM_TOP)


@pytest.mark.slow
def test_pipeline_parallel_matches(engines, expected):
    assert tokens_of(engines("pp2")) == expected


def test_torch_compile_and_weight_quantization_are_refused_naming_the_model(checkpoint):
    """The captured decode step does not take per-group block tables yet, and gpt-oss's experts ship in MXFP4:
    asked for anyway, each is an error naming the option and the model (it used to decode eagerly, or fail
    late with a bare ValueError), before any weight is loaded."""
    for options, option in ((dict(enable_torch_compile=True), "--enable-torch-compile"),
                            (dict(quantization="fp8"), "--quantization fp8"),
                            (dict(quantization="int8"), "--quantization int8")):
        with pytest.raises(EngineConfigError, match=f"{option} with GptOssForCausalLM"):
            LLM(str(checkpoint), device="cpu", dtype="float32", block_size=BLOCK, **options)


# ---------------------------------------------------------------------------------------- MXFP4
@pytest.fixture(scope="module")
def twin_expected(mxfp4_checkpoints):
    twin, _ = mxfp4_checkpoints
    tokens = HFOracle(twin).greedy(PROMPTS, NEW_TOKENS)
    return tokens


@pytest.mark.parametrize("quantization", [None, "mxfp4"], ids=["dequantized", "kept_mxfp4"])
def test_mxfp4_checkpoint_gives_the_tokens_of_its_dequantized_twin(mxfp4_checkpoints, twin_expected, quantization):
    _, mxfp4 = mxfp4_checkpoints
    config = json.loads((mxfp4 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    with LLM(str(mxfp4), device="cpu", dtype="float32", block_size=BLOCK, quantization=quantization) as llm:
        experts = llm.core.model.model.layers[0].mlp.experts
        assert experts.w13.dtype == (torch.uint8 if quantization else torch.float32)
        assert tokens_of(llm) == twin_expected
