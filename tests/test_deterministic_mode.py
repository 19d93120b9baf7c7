"""`LLM(deterministic=True)`: a request's tokens and logprobs are bitwise the same whatever else is batched with it.

One target prompt (66 tokens: past one 64-key attention block, over several KV blocks) is generated alone, then
beside 1 and 16 other prompts of other lengths, then chunked (a step budget of 8 tokens), then as a prefix-cache
hit (and a seeded sample alone vs batched); the token ids and every logprob (the sampled token's and its top
alternatives) must be equal as floats, not close. Each family's tokens are transformers' greedy ones; the other
families (shared experts, sinks and windows, DeepSeek-V3's multi-head latent attention) pass the same checks, and
Kimi K2's model type gives DeepSeek-V3's bits. The same on
`ep=2, dp_attn=2` with two-batch overlap, the target served once by each DP worker. And without the mode the same
comparison does differ on this CPU (the BLAS blocks a projection by its row count), so the equality above is the
mode's doing, not the model's.
"""
import pytest

from engine_helpers import greedy
from lazy_engines import tiny_engine_pool
from moe_runtime import LLM, SamplingParams
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.server.cli import build_parser, engine_config_from_args
from test_renamed_architectures import as_kimi

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
    """get(arch, layout) -> the tiny checkpoint's engine, built once per module."""
    with tiny_engine_pool(tiny_checkpoint_factory, LAYOUTS) as get:
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


def prefix_hit_answer(llm: LLM) -> tuple:
    """`answer`'s for the target found in the prefix cache: three of its KV blocks cached by an earlier prompt."""
    llm.engine.reset_prefix_cache()
    llm.generate([SHARES_PREFIX], greedy(1))
    hits = sum(w.prefix_cache_hits for w in llm.engine.stats().workers)
    outputs = llm.generate([TARGET, OTHERS[4]], greedy(NEW_TOKENS, logprobs=TOP_LOGPROBS))
    assert sum(w.prefix_cache_hits for w in llm.engine.stats().workers) - hits >= 48, "no prefix-cache hit"
    return tuple(outputs[0].token_ids), tuple((lp.token_id, lp.logprob, tuple(sorted(lp.top.items())))
                                              for lp in outputs[0].logprobs)


def check_alone_batched_chunked_and_cached(engines, arch: str, greedy_oracle) -> tuple:
    """The target alone gives transformers' tokens, and the same bits beside 1 and 16 others, in 8-token chunks
    and as a prefix-cache hit; returns the alone answer."""
    llm = engines(arch, "one rank")
    alone = answer(llm, [])
    assert list(alone[0]) == greedy_oracle(arch, [TARGET], NEW_TOKENS)[0]   # the fixed-order kernels are the model's
    assert len(alone[1]) == NEW_TOKENS
    assert answer(llm, OTHERS[:1]) == alone, "beside one other prompt"
    assert answer(llm, OTHERS, first=False) == alone, "after 16 other prompts"
    assert answer(engines(arch, "one rank, chunked"), OTHERS[:3]) == alone, "chunked prefill (8-token steps)"
    assert prefix_hit_answer(llm) == alone, "a prefix-cache hit"
    return alone


def admitted_tokens(llm: LLM) -> list[int]:
    """Per DP worker, the prompt tokens it has admitted so far."""
    return [w.prefix_cache_queries for w in llm.engine.stats().workers]


def test_one_rank_alone_batched_chunked_and_cached_are_bitwise_equal(engines, greedy_oracle):
    check_alone_batched_chunked_and_cached(engines, ARCH, greedy_oracle)
    llm = engines(ARCH, "one rank")
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, logprobs=2)
    assert answer(llm, [], params=sampled) == answer(llm, OTHERS, first=False, params=sampled), "a seeded sample"


def test_without_the_mode_a_batch_changes_the_logprobs(engines):
    """The same comparison with the torch family: some logprob differs (else the test above proves nothing)."""
    llm = engines(ARCH, "one rank, off")
    alone = answer(llm, [])
    assert answer(llm, OTHERS) != alone


def test_expert_parallel_dp_workers_with_two_batch_overlap(engines):
    llm = engines(ARCH, "ep2 dp2 tbo")
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
    """DeepSeek-V3.2's sparse MLA (its indexer picks each row's keys) has no fixed-order path yet."""
    with pytest.raises(EngineConfigError, match="DeepseekV32ForCausalLM: its SparseLatentAttention layers"):
        LLM(str(tiny_checkpoint_factory("deepseek_v32")), device="cpu", dtype="float32", deterministic=True).generate(
            [[1, 2, 3]], greedy(1))


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_other_families_alone_batched_chunked_and_cached_are_bitwise_equal(arch, engines, greedy_oracle):
    """qwen2_moe: shared expert behind a sigmoid gate, a dense layer; gpt_oss: sliding-window layers, sinks, expert
    biases and the clamped SwiGLU; deepseek_v3: multi-head latent attention (absorbed on every path: prefill,
    chunks over their prefix, decode), grouped sigmoid routing, shared experts, a dense layer."""
    check_alone_batched_chunked_and_cached(engines, arch, greedy_oracle)


def test_kimi_k2_runs_as_deepseek_v3(engines, tiny_checkpoint_factory, tmp_path):
    """Kimi K2 names its DeepSeek-V3 backbone `kimi_k2`: the same layers, so the same bits."""
    kimi = as_kimi(tiny_checkpoint_factory("deepseek_v3"), tmp_path / "kimi")
    with LLM(str(kimi), device="cpu", dtype="float32", deterministic=True) as llm:
        assert answer(llm, OTHERS[:1]) == answer(engines("deepseek_v3", "one rank"), [])
