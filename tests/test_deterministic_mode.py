"""`LLM(deterministic=True)`: a request's tokens and logprobs are bitwise the same whatever else is batched with it.

One target prompt (66 tokens: past one 64-key attention block, over several KV blocks) is generated alone, then
beside 1 and 16 other prompts of other lengths, then chunked (a step budget of 8 tokens), then as a prefix-cache
hit (and a seeded sample alone vs batched); the token ids and every logprob (the sampled token's and its top
alternatives) must be equal as floats, not close. Each family's tokens are transformers' greedy ones. The same on
`ep=2, dp_attn=2` with two-batch overlap, the target served once by each DP worker. And without the mode the same
comparison does differ on this CPU (the BLAS blocks a projection by its row count), so the equality above is the
mode's doing, not the model's.
"""
import pytest

from engine_helpers import greedy
from lazy_engines import engine_pool
from moe_runtime import LLM, SamplingParams
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.server.cli import build_parser, engine_config_from_args

ARCH = "qwen3_moe"
NEW_TOKENS = 4
TOP_LOGPROBS = 3
TARGET = [(7 * i + 3) % 500 + 1 for i in range(66)]
OTHERS = [[(11 * i + 5 * n) % 500 + 1 for i in range(1 + (9 * n) % 37)] for n in range(16)]   # 1..37 tokens
SHARES_PREFIX = TARGET[:48] + [9, 9, 9]   # three full KV blocks of the target, then something else
LAYOUTS = {
    "one rank": dict(deterministic=True),
    "one rank, chunked": dict(deterministic=True, max_num_batched_tokens=8),
    "one rank, off": dict(),
    "ep2 dp2 tbo": dict(deterministic=True, ep=2, dp_attn=2, enable_two_batch_overlap=True, cache_aware_routing=False),
}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory):
    path = str(tiny_checkpoint_factory(ARCH))
    with engine_pool(lambda layout: LLM(path, device="cpu", dtype="float32", **LAYOUTS[layout])) as get:
        yield get


def answer(llm: LLM, others: list[list[int]], first: bool = True, params: SamplingParams | None = None) -> tuple:
    """The target's (token ids, logprobs with their top alternatives), generated beside `others` (after them
    unless `first`), on an empty prefix cache; greedy unless `params`."""
    llm.engine.reset_prefix_cache()
    prompts = [TARGET] + others if first else others + [TARGET]
    outputs = llm.generate(prompts, params or greedy(NEW_TOKENS, logprobs=TOP_LOGPROBS))
    target = outputs[0] if first else outputs[-1]
    return tuple(target.token_ids), tuple((lp.token_id, lp.logprob, tuple(sorted(lp.top.items())))
                                          for lp in target.logprobs)


def admitted_tokens(llm: LLM) -> list[int]:
    """Per DP worker, the prompt tokens it has admitted so far."""
    return [w.prefix_cache_queries for w in llm.engine.stats().workers]


def test_one_rank_alone_batched_chunked_and_cached_are_bitwise_equal(engines, greedy_oracle):
    llm = engines("one rank")
    alone = answer(llm, [])
    assert list(alone[0]) == greedy_oracle(ARCH, [TARGET], NEW_TOKENS)[0]   # the fixed-order kernels are the model's
    assert len(alone[1]) == NEW_TOKENS
    assert answer(llm, OTHERS[:1]) == alone, "beside one other prompt"
    assert answer(llm, OTHERS, first=False) == alone, "after 16 other prompts"
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, logprobs=2)
    assert answer(llm, [], params=sampled) == answer(llm, OTHERS, first=False, params=sampled), "a seeded sample"
    assert answer(engines("one rank, chunked"), OTHERS[:3]) == alone, "chunked prefill (8-token steps)"
    llm.engine.reset_prefix_cache()
    llm.generate([SHARES_PREFIX], greedy(1))
    hits = sum(w.prefix_cache_hits for w in llm.engine.stats().workers)
    outputs = llm.generate([TARGET, OTHERS[4]], greedy(NEW_TOKENS, logprobs=TOP_LOGPROBS))
    cached = (tuple(outputs[0].token_ids), tuple((lp.token_id, lp.logprob, tuple(sorted(lp.top.items())))
                                                 for lp in outputs[0].logprobs))
    assert sum(w.prefix_cache_hits for w in llm.engine.stats().workers) - hits >= 48, "no prefix-cache hit"
    assert cached == alone, "a prefix-cache hit"


def test_without_the_mode_a_batch_changes_the_logprobs(engines):
    """The same comparison with the torch family: some logprob differs (else the test above proves nothing)."""
    llm = engines("one rank, off")
    alone = answer(llm, [])
    assert answer(llm, OTHERS) != alone


def test_expert_parallel_dp_workers_with_two_batch_overlap(engines):
    llm = engines("ep2 dp2 tbo")
    before = admitted_tokens(llm)
    alone = answer(llm, [])
    after_alone = admitted_tokens(llm)
    beside = answer(llm, [OTHERS[15] * 3], first=False)   # a long prompt first: the target goes to the other worker
    after_beside = admitted_tokens(llm)
    served_alone = [a - b for a, b in zip(after_alone, before)].index(len(TARGET))
    served_beside = [a - b for a, b in zip(after_beside, after_alone)].index(len(TARGET))
    assert served_alone != served_beside, "the target was served by the same DP worker both times"
    assert beside == alone


def test_options_without_invariant_kernels_are_refused_by_name():
    args = build_parser().parse_args(["--model", "unused", "--deterministic"])
    assert engine_config_from_args(args).deterministic
    for option, flag in ((dict(quantization="int8"), "--quantization int8"),
                         (dict(enable_torch_compile=True), "--enable-torch-compile"),
                         (dict(cp=2, ep=2), "--cp 2")):
        with pytest.raises(EngineConfigError, match=flag):
            EngineConfig(model="unused", deterministic=True, **option).validate_options()


def test_models_without_fixed_order_attention_are_refused(tiny_checkpoint_factory):
    with pytest.raises(EngineConfigError, match="DeepseekV3ForCausalLM: its MultiHeadLatentAttention layers"):
        LLM(str(tiny_checkpoint_factory("deepseek_v3")), device="cpu", dtype="float32", deterministic=True).generate(
            [[1, 2, 3]], greedy(1))


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_other_families_alone_and_batched_are_bitwise_equal(arch, tiny_checkpoint_factory, greedy_oracle):
    """qwen2_moe: shared expert behind a sigmoid gate, a dense layer; gpt_oss: sliding-window layers, sinks, expert
    biases and the clamped SwiGLU. Each: transformers' tokens, and the same bits beside 16 prompts."""
    with LLM(str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", deterministic=True) as llm:
        alone = answer(llm, [])
        assert list(alone[0]) == greedy_oracle(arch, [TARGET], NEW_TOKENS)[0]
        assert answer(llm, OTHERS, first=False) == alone
