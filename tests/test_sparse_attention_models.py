"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`), DeepSeek Sparse Attention: each
query attends only to the tokens its layer's lightning indexer scored best. They give transformers' greedy tokens
and prompt logprobs on one rank, with prefills cut into steps of a few tokens, with a cached prefix reused, with
captured decode steps, with EP + DP attention, with attention TP, with context parallelism, with two pipeline
stages, with two-batch overlap and with n-gram speculative decoding (a verify step's queries each choose their own tokens). P/D:
tests/test_pd_sparse_attention.py; the Triton kernel: tests/test_sparse_attention_triton.py.

The tiny models keep 8 tokens per query (`index_topk`) and the prompts are 17 to 40 tokens long, several KV blocks:
most queries see more tokens than they may attend to, so a wrong choice changes the tokens (the oracle's own tokens
with every token attended differ: `test_the_indexer_really_limits_attention`). GLM-5's third layer reuses its
second layer's choice (a shared indexer layer); a pipeline split that would part them is refused by name.
"""
from __future__ import annotations

import pytest
import torch

from lazy_engines import tiny_engine_pool
from engine_helpers import greedy
from fp8_checkpoints import write_fp8_checkpoint
from test_prompt_logprobs import assert_prompt_logprobs_match, expected_logprobs
from tiny_checkpoints import HFOracle
from moe_runtime import LLM
from moe_runtime.errors import EngineDeadError

ARCHS = ["deepseek_v32", "glm_moe_dsa"]
INDEX_TOPK = 8
NEW_TOKENS = 6
NUM_TOP = 3
PROMPTS = [  # several KV blocks of 16, all longer than INDEX_TOPK
    [(7 * i + 3) % 500 + 5 for i in range(40)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(37)],
    [(13 * i + 4) % 470 + 6 for i in range(17)],
]
SHARED_PREFIX = PROMPTS[0][:32] + [(3 * i + 11) % 450 + 8 for i in range(6)]   # two cached blocks, its own tail
LAYOUTS = {
    "one_rank": {},
    "chunked_prefix": dict(max_num_batched_tokens=5, enable_chunked_prefill=True, enable_prefix_caching=True),
    "ep2_dp2": dict(ep=2, dp_attn=2),
    "ep2_attention_tp2": dict(ep=2, dp_attn=1),   # 8 MLA heads split in two; each rank runs the whole indexer
    "pp2": dict(pp=2, pp_layers=(1, 2)),
    "cp2": dict(ep=2, cp=2, max_num_batched_tokens=16),   # each prompt in zigzag pieces on two ranks, chunked
    "captured_decode": dict(enable_torch_compile=True, torch_compile_backend="eager"),   # dynamo, fullgraph
    "two_batch_overlap": dict(ep=2, dp_attn=1, enable_two_batch_overlap=True),   # a step as two micro-batches
    "ngram_speculation": dict(speculative_config=dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                                      prompt_lookup_max=3)),
}
SPECULATED_TOKENS = 24   # long enough for a tiny model's continuation to repeat itself (drafts found)
REPEATING = [[7, 8, 9] * 6 + [1, 2], [11, 23] * 12]   # the tiny models' continuations repeat: some drafts hold


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory):
    with tiny_engine_pool(tiny_checkpoint_factory, LAYOUTS) as get:
        yield get


@pytest.fixture(scope="module")
def expected(greedy_oracle):
    """arch (, prompts) -> transformers' tokens, which must vary (the same one or two tokens would test little)."""
    def get(arch: str, prompts: list[list[int]] = PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
        tokens = greedy_oracle(arch, prompts, new_tokens)
        assert max(len(set(continuation)) for continuation in tokens) > 2, f"{arch}: degenerate oracle tokens"
        return tokens
    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_the_indexer_really_limits_attention(arch, tiny_checkpoint_factory, expected):
    """The same weights attending to every token continue differently: the top-k choice is what is tested."""
    assert min(map(len, PROMPTS)) > 2 * INDEX_TOPK
    dense = HFOracle(tiny_checkpoint_factory(arch, index_topk=4096)).greedy(PROMPTS, NEW_TOKENS)
    assert dense != expected(arch)


def assert_tokens_and_prompt_logprobs_match(llm: LLM, arch: str, expected, hf_oracles) -> None:
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected(arch)
    for prompt, output in zip(PROMPTS, outputs):
        want = expected_logprobs(hf_oracles(arch), prompt)
        assert_prompt_logprobs_match(output.prompt_logprobs, want, prompt, NUM_TOP)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_tokens_and_prompt_logprobs_equal_transformers(arch, engines, expected, hf_oracles):
    assert_tokens_and_prompt_logprobs_match(engines(arch, "one_rank"), arch, expected, hf_oracles)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_a_cached_prefix_keep_the_tokens(arch, engines, expected):
    """Prefills in steps of 5 tokens (each chunk's queries choose among the earlier chunks' cached index keys);
    then a prompt sharing the first two blocks of one already served reads their latents and index keys from
    the prefix cache."""
    llm = engines(arch, "chunked_prefix")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)
    hits = llm.engine.stats().prefix_cache_hits
    [shared] = llm.generate([SHARED_PREFIX], greedy(NEW_TOKENS))
    assert llm.engine.stats().prefix_cache_hits > hits, "the shared prefix did not reuse its cached blocks"
    assert shared.token_ids == expected(arch, [SHARED_PREFIX])[0]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_an_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(quantization, tiny_checkpoint_factory,
                                                                          tmp_path_factory):
    """DeepSeek-V3.2's published layout: every decoder linear in FP8 blocks, the indexer's projections too;
    dequantized at load, or kept in FP8 (the indexer's wq_b and wk then run the FP8 linear)."""
    root = tmp_path_factory.mktemp(f"fp8-{quantization}")
    fp8, oracle = write_fp8_checkpoint(tiny_checkpoint_factory("deepseek_v32"), root / "fp8", root / "oracle",
                                       (32, 48), with_mtp=True)
    with LLM(str(fp8), device="cpu", dtype="float32", quantization=quantization) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        indexer = llm.core.model.model.layers[1].self_attn.indexer
        assert (indexer.wq_b.weight.dtype == torch.float8_e4m3fn) == (quantization == "fp8")
    assert tokens == HFOracle(oracle).greedy(PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_decode_steps_choose_on_the_device(arch, engines, expected):
    """Decode steps traced whole (no graph break): each row scores the keys its block table covers, masked past
    its context, with no host list to loop over."""
    llm = engines(arch, "captured_decode")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)
    stats = llm.core.runner.capture.stats
    assert stats.disabled_reason is None and stats.captured_steps == NEW_TOKENS - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_decoding_verifies_drafts_with_each_draft_choosing_its_own_tokens(arch, engines, expected):
    """A verify step runs 1 + d queries of a sequence at once, each choosing its top-k tokens causally."""
    llm = engines(arch, "ngram_speculation")
    outputs = llm.generate(REPEATING, greedy(SPECULATED_TOKENS))
    assert [o.token_ids for o in outputs] == expected(arch, REPEATING, SPECULATED_TOKENS)
    workers = llm.engine.stats().workers
    accepted, drafted = sum(w.spec_accepted_tokens for w in workers), sum(w.spec_draft_tokens for w in workers)
    assert 0 < accepted < drafted, (accepted, drafted)   # drafts kept and drafts rolled back


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_expert_parallel_with_dp_attention_matches(arch, engines, expected):
    llm = engines(arch, "ep2_dp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)
    [single] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))   # the other DP worker runs empty batches
    assert single.token_ids == expected(arch)[1]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_tensor_parallel_matches(arch, engines, expected, hf_oracles):
    assert_tokens_and_prompt_logprobs_match(engines(arch, "ep2_attention_tp2"), arch, expected, hf_oracles)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "pp2", "two_batch_overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_parallel_layouts_keep_the_tokens(arch, layout, engines, expected):
    """cp2: each rank runs zigzag pieces of every prompt, whose queries choose among the whole context (the ranks
    exchange the index keys with the latents); pp2: GLM-5's shared layer 2 on the stage of layer 1, which chooses
    for it; two_batch_overlap: two micro-batches interleave layer by layer, each keeping its own choice."""
    assert [o.token_ids for o in engines(arch, layout).generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)


@pytest.mark.slow
def test_a_stage_starting_at_a_shared_indexer_layer_is_refused(tiny_checkpoint_factory):
    """Split evenly, GLM-5's second stage would start at layer 2, whose tokens layer 1 on the first stage chooses."""
    with pytest.raises(EngineDeadError, match=r"InvalidRequestError: pp=2: .* shared indexer layer that reuses "
                                              r"layer 1's tokens.* pp_layers"):
        LLM(str(tiny_checkpoint_factory("glm_moe_dsa")), device="cpu", dtype="float32", pp=2)
