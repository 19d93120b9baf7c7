"""GLM-4.5 (`Glm4MoeForCausalLM`) and MiniMax-M2 (`MiniMaxM2ForCausalLM`) give transformers' greedy tokens and
prompt logprobs on one rank, with EP + DP attention, with attention TP, with two pipeline stages, and with chunked
prefill + prefix caching.

The GLM checkpoint carries a multi-token-prediction layer's tensors after its last decoder layer (as the published
ones do, `num_nextn_predict_layers=1`): the loader must skip them, not refuse the checkpoint. Every prompt is longer
than a KV block (16 tokens), so decode reads paged blocks and a repeated prompt hits the prefix cache.
Engines are built once per module, on first use, and shared by the tests; transformers runs on the checkpoints as
saved (the MTP tensors change nothing transformers computes).
"""
from __future__ import annotations

import json

import pytest
import torch

from lazy_engines import engine_pool
from engine_helpers import greedy
from test_prompt_logprobs import assert_prompt_logprobs_match, expected_logprobs
from moe_runtime import LLM
from moe_runtime.errors import InvalidRequestError
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint
from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors

ARCHS = ["glm4_moe", "minimax_m2"]
NEW_TOKENS = 6
NUM_TOP = 3
PROMPTS = [  # all longer than one block of 16
    [(7 * i + 3) % 500 + 5 for i in range(40)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(37)],
    [(13 * i + 4) % 470 + 6 for i in range(17)],
]
LAYOUTS = {   # name -> LLM options
    "one_rank": {},
    "chunked_prefix": dict(max_num_batched_tokens=16, enable_chunked_prefill=True, enable_prefix_caching=True),
    "ep2_dp2": dict(ep=2, dp_attn=2),
    "ep2_attention_tp2": dict(ep=2, dp_attn=1),   # one DP worker over two ranks: the heads split in two
    "pp2": dict(pp=2),                            # two stages: GLM's dense first layer and MoE on the first
}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """arch -> the checkpoint the runtime loads: GLM's with an MTP layer appended (two shards), MiniMax-M2's as saved."""
    glm = tiny_checkpoint_factory("glm4_moe")
    with_mtp = tmp_path_factory.mktemp("glm4_moe_mtp")
    config = json.loads((glm / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1, "transformers' GLM config names its MTP layers"
    write_mtp_checkpoint(glm, with_mtp)
    return {"glm4_moe": with_mtp, "minimax_m2": tiny_checkpoint_factory("minimax_m2")}


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(arch, layout) -> its `LLM`, built on first use and shut down after the module."""
    with engine_pool(lambda arch, layout: LLM(str(checkpoints[arch]), device="cpu", dtype="float32",
                                              **LAYOUTS[layout])) as get:
        yield get


@pytest.fixture(scope="module")
def expected(greedy_oracle):
    def get(arch: str) -> list[list[int]]:
        tokens = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
        assert any(len(set(t)) > 2 for t in tokens), "oracle output is degenerate; the test would be weak"
        return tokens
    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_tokens_and_prompt_logprobs_equal_transformers(arch, engines, expected, hf_oracles):
    outputs = engines(arch, "one_rank").generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected(arch)
    for prompt, output in zip(PROMPTS, outputs):
        want = expected_logprobs(hf_oracles(arch), prompt)
        assert_prompt_logprobs_match(output.prompt_logprobs, want, prompt, NUM_TOP)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_prefix_caching_keep_the_tokens(arch, engines, expected):
    llm = engines(arch, "chunked_prefix")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)
    hits = llm.engine.stats().prefix_cache_hits
    [again] = llm.generate([PROMPTS[0]], greedy(NEW_TOKENS))   # its first two blocks are cached
    assert llm.engine.stats().prefix_cache_hits > hits, "the repeated prompt did not reuse its cached blocks"
    assert again.token_ids == expected(arch)[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_expert_parallel_with_dp_attention_matches(arch, engines, expected):
    llm = engines(arch, "ep2_dp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)
    [single] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))   # the other DP worker runs empty batches
    assert single.token_ids == expected(arch)[1]
    for rank, (local, total) in llm.engine.client.resident_expert_bytes().items():
        assert local * 2 == total, f"rank {rank} holds {local} of {total} routed-expert bytes"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_tensor_parallel_matches(arch, engines, expected, hf_oracles):
    """Heads split over two ranks: GLM's per-head q/k norm stays local, MiniMax-M2's norm over the whole
    projection all-reduces its sum of squares; both keep transformers' tokens and prompt logprobs."""
    llm = engines(arch, "ep2_attention_tp2")
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected(arch)
    prompt = PROMPTS[0]
    assert_prompt_logprobs_match(outputs[0].prompt_logprobs, expected_logprobs(hf_oracles(arch), prompt), prompt,
                                 NUM_TOP)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_parallel_stages_match(arch, engines, expected):
    """Layers split over two stages (GLM's MTP tensors skipped on both: neither stage owns them)."""
    llm = engines(arch, "pp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_tensor_parallelism_is_refused_by_name(arch, checkpoints):
    """`tp` splits dense models; an MoE model splits its attention with ep / dp_attn instead."""
    with pytest.raises(InvalidRequestError, match=r"tensor parallelism is for dense models"):
        LLM(str(checkpoints[arch]), device="cpu", tp=2)


def test_glm_checkpoint_really_holds_the_mtp_layer(checkpoints):
    """The skip is tested only if the MTP tensors are there (and the runtime loaded that checkpoint above)."""
    names = read_all_tensors(checkpoints["glm4_moe"])
    assert any(name.startswith("model.layers.3.eh_proj") for name in names)
    assert torch.is_tensor(names["model.layers.3.mlp.gate.e_score_correction_bias"])
