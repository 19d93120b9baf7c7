"""Llama 4 text (`Llama4ForCausalLM`) gives transformers' greedy tokens and prompt logprobs on one rank, with EP + DP
attention, with attention TP, with two pipeline stages, with chunked prefill + prefix caching and with a captured
decode step; its chunked layers keep only their chunk's KV blocks however long a sequence grows.

The tiny model (tests/tiny_checkpoints.py "llama4"): chunks of 8 on layers 0-2, layer 3 NoPE with temperature
tuning stepping every 4 positions, top-1 sigmoid experts on layers 1 and 3 scaling their input. Blocks are 4
tokens, prompts up to five chunks long; prefill chunks of 12 tokens end inside attention chunks.
Engines are built once per module, on first use, and shared by the tests.
"""
from __future__ import annotations

import pytest
import torch

from engine_helpers import greedy
from lazy_engines import lazy_engines
from test_prompt_logprobs import assert_prompt_logprobs_match, expected_logprobs
from tiny_checkpoints import HFOracle
from window_watch import window_blocks_held
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_span import CHUNKED, AttentionSpan
from moe_runtime.layers.query_temperature import QueryTemperature
from moe_runtime.models.attention_spans import attention_spans
from moe_runtime.models.llama4 import llama4_routing

ARCH = "llama4"
CHUNK, BLOCK = 8, 4
HELD_BOUND = -(-CHUNK // BLOCK) + 1          # ceil(C / block_size) + 1
NEW_TOKENS = 8
NUM_TOP = 3
PROMPTS = [  # 2 to 5 chunks of 8
    [(7 * i + 3) % 500 + 5 for i in range(40)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(37)],
    [(13 * i + 4) % 470 + 6 for i in range(17)],
]
LAYOUTS = {   # name -> LLM options (besides block_size)
    "one_rank": {},
    "chunked_prefix": dict(max_num_batched_tokens=12, enable_chunked_prefill=True, enable_prefix_caching=True),
    "ep2_dp2": dict(ep=2, dp_attn=2),
    "ep2_attention_tp2": dict(ep=2, dp_attn=1),   # one DP worker over two ranks: the heads split in two
    "pp2": dict(pp=2),                            # layers 0-1 and 2-3: a chunked and a NoPE layer on the second
    "captured": dict(enable_torch_compile=True, torch_compile_backend="eager"),   # unchunked checkpoints only
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(ARCH)


@pytest.fixture(scope="module")
def engines(checkpoint):
    """layout -> its `LLM`, built on first use and shut down after the module."""
    with lazy_engines(checkpoint, LAYOUTS, device="cpu", dtype="float32", block_size=BLOCK) as get:
        yield get


@pytest.fixture(scope="module")
def oracle(checkpoint) -> HFOracle:
    return HFOracle(checkpoint)


@pytest.fixture(scope="module")
def expected(greedy_oracle) -> list[list[int]]:
    tokens = greedy_oracle(ARCH, PROMPTS, NEW_TOKENS)
    assert any(len(set(t)) > 2 for t in tokens), "oracle output is degenerate; the test would be weak"
    return tokens


def test_the_config_declares_what_the_model_builds(oracle):
    """Chunked spans on the rotary layers, full on the NoPE one; the temperature changes within a prompt."""
    cfg = oracle.config
    assert list(cfg.no_rope_layers) == [1, 1, 1, 0] and list(cfg.moe_layers) == [1, 3]
    assert attention_spans(cfg) == [AttentionSpan(CHUNKED, CHUNK)] * 3 + [AttentionSpan()]
    scales = QueryTemperature(cfg.attn_scale, cfg.floor_scale).scales(torch.arange(40))
    assert scales[:3].eq(1).all() and len(set(scales.tolist())) > 5


def test_one_rank_tokens_and_prompt_logprobs_equal_transformers(engines, expected, oracle):
    llm = engines("one_rank")
    assert [w.span for w in llm.core.block_manager.windows] == [AttentionSpan(CHUNKED, CHUNK)]
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected
    for prompt, output in zip(PROMPTS, outputs):
        assert_prompt_logprobs_match(output.prompt_logprobs, expected_logprobs(oracle, prompt), prompt, NUM_TOP)


def test_chunked_prefill_and_prefix_caching_keep_the_tokens(engines, expected, oracle):
    llm = engines("chunked_prefix")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
    hits = llm.engine.stats().prefix_cache_hits
    [again] = llm.generate([PROMPTS[0]], greedy(NEW_TOKENS))   # its cached blocks and chunk are reused
    assert llm.engine.stats().prefix_cache_hits > hits, "the repeated prompt did not reuse its cached blocks"
    assert again.token_ids == expected[0]
    [scored] = llm.generate([PROMPTS[2]], greedy(1, prompt_logprobs=NUM_TOP))   # scored chunk by chunk
    assert_prompt_logprobs_match(scored.prompt_logprobs, expected_logprobs(oracle, PROMPTS[2]), PROMPTS[2], NUM_TOP)


def test_a_chunked_layer_holds_at_most_its_chunk_over_a_long_generation(engines):
    core = engines("one_rank").core
    with window_blocks_held(core) as held:
        out = engines("one_rank").generate([PROMPTS[0]], greedy(60))[0]
    assert len(out.token_ids) == 60
    decode_steps = held[-59:]
    assert max(decode_steps) <= HELD_BOUND, decode_steps
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_captured_decode_keeps_the_tokens(checkpoint, tiny_checkpoint_factory):
    """With chunked groups a captured step is refused naming the option and the model (it takes no per-group
    tables yet; it used to decode eagerly after a log line); without chunks (every layer full) the captured step
    traces the NoPE layer's temperature, the layers without rotary and the weightless q/k norm, and gives
    transformers' tokens."""
    with pytest.raises(EngineConfigError, match="--enable-torch-compile with Llama4ForCausalLM: .*windowed"):
        LLM(str(checkpoint), device="cpu", dtype="float32", block_size=BLOCK, **LAYOUTS["captured"])
    unchunked = tiny_checkpoint_factory(ARCH, attention_chunk_size=None)
    want = HFOracle(unchunked).greedy(PROMPTS, NEW_TOKENS)
    with LLM(str(unchunked), device="cpu", dtype="float32", block_size=BLOCK, **LAYOUTS["captured"]) as captured:
        assert captured.core.block_manager.windows == []
        assert [o.token_ids for o in captured.generate(PROMPTS, greedy(NEW_TOKENS))] == want
        stats = captured.core.runner.capture.stats
    assert stats.disabled_reason is None and stats.captured_steps == NEW_TOKENS - 1


@pytest.mark.slow
def test_expert_parallel_with_dp_attention_matches(engines, expected):
    llm = engines("ep2_dp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
    for rank, (local, total) in llm.engine.client.resident_expert_bytes().items():
        assert local * 2 == total, f"rank {rank} holds {local} of {total} routed-expert bytes"


@pytest.mark.slow
def test_attention_tensor_parallel_matches(engines, expected, oracle):
    """Heads split over two ranks: the q/k norm and the query temperature are per head, so stay local."""
    llm = engines("ep2_attention_tp2")
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected
    prompt = PROMPTS[0]
    assert_prompt_logprobs_match(outputs[0].prompt_logprobs, expected_logprobs(oracle, prompt), prompt, NUM_TOP)


@pytest.mark.slow
def test_two_pipeline_stages_match(engines, expected):
    llm = engines("pp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected


def test_top_k_above_one_is_refused_by_name(oracle):
    """transformers scales each chosen expert's input by its own score; only top-1 is implemented."""
    cfg = oracle.config.__class__(**{**oracle.config.to_dict(), "num_experts_per_tok": 2})
    with pytest.raises(UnsupportedArchitectureError, match="num_experts_per_tok=2"):
        llama4_routing(cfg)
