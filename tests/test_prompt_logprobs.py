"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal transformers' log-softmax of the same checkpoint.

Position i's logits score prompt token i+1 (the first token has none); the top alternatives, the ranks
and the values are held against transformers' fp32 forward within 1e-4 on every layout of `LAYOUTS`.
Each engine is built once for the module, on first use.
"""
from dataclasses import dataclass, field

import pytest
import torch

from moe_runtime.attention_dp.messages import MessageCodec, StepOutputs
from engine_helpers import PROMPTS, greedy
from tiny_checkpoints import HFOracle
from moe_runtime import LLM, SamplingParams
from moe_runtime.sampling.logprobs import PromptLogprobs, PromptTokenLogprob
from moe_runtime.engine.stats import WorkerStats
from moe_runtime.errors import InvalidRequestError
from moe_runtime.front.output_processor import OutputProcessor
from moe_runtime.records.outputs import TokenDelta

ATOL = 1e-4
NUM_TOP = 3
SMALL_KV = 8 * 16 * 2**10   # 8 KV blocks of the tiny llama (1 KiB per token): long requests get preempted
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(70)]


@pytest.fixture(scope="module")
def oracles(tiny_checkpoint_factory):
    """arch -> the transformers model of its tiny checkpoint (loaded once)."""
    cache = {}

    def get(arch: str) -> HFOracle:
        if arch not in cache:
            cache[arch] = HFOracle(tiny_checkpoint_factory(arch))
        return cache[arch]
    return get


@dataclass(frozen=True)
class Layout:
    arch: str
    options: dict = field(default_factory=dict)


# one rank (small KV cache: long batches get preempted); MLA with EP and DP attention (the values cross the
# control plane); a vocabulary-parallel LM head on the last of two pipeline stages
LAYOUTS = {
    "llama": Layout("llama", dict(kv_cache_memory=SMALL_KV)),
    "deepseek_v3-ep2-dp2": Layout("deepseek_v3", dict(ep=2, dp_attn=2)),
    "llama-tp2-pp2": Layout("llama", dict(tp=2, pp=2)),
}
MULTI_RANK = [name for name, layout in LAYOUTS.items() if layout.options.keys() & {"ep", "tp", "pp"}]
LAYOUT_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if name in MULTI_RANK else []) for name in LAYOUTS]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory):
    """name -> its `LLM` of `LAYOUTS`, built on first use and shared by the module's tests."""
    built: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in built:
            layout = LAYOUTS[name]
            built[name] = LLM(str(tiny_checkpoint_factory(layout.arch)), device="cpu", dtype="float32",
                              **layout.options)
        return built[name]
    yield get
    for llm in built.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def llama(engines):
    return engines("llama")


def expected_logprobs(oracle: HFOracle, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax [P-1, V] of positions 0..P-2 (position i scores prompt token i+1)."""
    return oracle.prefill_logits(prompt)[:-1].log_softmax(dim=-1)


def assert_prompt_logprobs_match(entries, expected: torch.Tensor, prompt: list[int], num_top: int) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] is None, "the first prompt token has nothing before it"
    scored = entries[1:]
    assert [e.token_id for e in scored] == prompt[1:]
    targets = torch.tensor(prompt[1:])[:, None]
    want = expected.gather(1, targets)[:, 0]                                            # [P-1]
    torch.testing.assert_close(torch.tensor([e.logprob for e in scored]), want, atol=ATOL, rtol=0)
    # a rank counts the strictly likelier tokens: exact up to ties within the tolerance
    fewest = (expected > want[:, None] + ATOL).sum(dim=-1) + 1
    most = (expected > want[:, None] - ATOL).sum(dim=-1) + 1
    ranks = torch.tensor([e.rank for e in scored])
    assert bool(((fewest <= ranks) & (ranks <= most)).all()), f"ranks {ranks} outside [{fewest}, {most}]"
    for entry, row in zip(scored, expected):
        assert len(entry.top) == num_top
        top_ids = list(entry.top)
        torch.testing.assert_close(torch.tensor([entry.top[t] for t in top_ids]), row[top_ids], atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(list(entry.top.values())), row.topk(num_top).values,
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_prompt_logprobs_equal_transformers(layout, engines, oracles):
    llm = engines(layout)
    oracle = oracles(LAYOUTS[layout].arch)
    scoring = greedy(4, prompt_logprobs=NUM_TOP)
    plain = greedy(4)
    # a batch over every DP worker; one request without prompt logprobs rides along unchanged
    params = [scoring, scoring, plain, scoring]
    outputs = llm.generate(PROMPTS, params)
    unscored = llm.generate(PROMPTS, plain)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in unscored], "scoring changed the tokens"
    for prompt, p, output in zip(PROMPTS, params, outputs):
        if p.prompt_logprobs is None:
            assert output.prompt_logprobs is None
            continue
        assert_prompt_logprobs_match(output.prompt_logprobs, expected_logprobs(oracle, prompt), prompt, NUM_TOP)


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_max_tokens_zero_scores_the_prompt_only(layout, engines, oracles):
    llm = engines(layout)
    prompt = PROMPTS[3]
    [output] = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0, logprobs=2))
    assert output.finished and output.finish_reason == "length"
    assert output.token_ids == [] and output.text == ""
    entries = output.prompt_logprobs
    assert_prompt_logprobs_match(entries, expected_logprobs(oracles(LAYOUTS[layout].arch), prompt), prompt, 0)
    assert all(e.top == {} for e in entries[1:]), "prompt_logprobs=0: the token's own logprob, no alternatives"


def test_one_token_prompt_has_only_the_none_entry(llama):
    [output] = llama.generate([[77]], SamplingParams(max_tokens=0, prompt_logprobs=5))
    assert output.prompt_logprobs == [None]


def test_long_prompt_is_scored_in_bounded_chunks(llama, oracles, monkeypatch):
    """A prompt longer than a chunk: the LM head never sees more than a chunk of positions at once."""
    core = llama.core
    chunk = 16
    monkeypatch.setattr(core.runner, "prompt_logprobs_chunk_tokens", chunk)
    rows_per_call = []
    project = core.model.logits

    def counting_logits(hidden):
        rows_per_call.append(hidden.shape[0])
        return project(hidden)

    monkeypatch.setattr(core.model, "logits", counting_logits)
    [output] = llama.generate([LONG_PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=NUM_TOP))
    assert rows_per_call == [chunk] * 4 + [len(LONG_PROMPT) - 1 - 4 * chunk] + [1], "not scored in chunks"
    assert_prompt_logprobs_match(output.prompt_logprobs, expected_logprobs(oracles("llama"), LONG_PROMPT),
                                 LONG_PROMPT, NUM_TOP)


def test_preempted_requests_send_their_prompt_logprobs_once(llama, oracles):
    """A preempted request recomputes its prefill; its prompt logprobs still travel in its first delta only."""
    core = llama.core
    prompts = [PROMPTS[1], PROMPTS[3], LONG_PROMPT[:30]]
    preempted_before = core.scheduler.num_preemptions
    for i, prompt in enumerate(prompts):
        core.add_request(f"preempted-{i}", prompt, greedy(24, prompt_logprobs=1))
    deltas: list[TokenDelta] = []
    while core.has_unfinished():
        deltas += core.step()
    assert core.scheduler.num_preemptions > preempted_before, "nothing was preempted: the test proves nothing"
    for i, prompt in enumerate(prompts):
        mine = [d for d in deltas if d.request_id == f"preempted-{i}"]
        carrying = [d for d in mine if d.prompt_logprobs is not None]
        assert carrying == mine[:1], f"request {i}: prompt logprobs in {len(carrying)} deltas"
        expected = expected_logprobs(oracles("llama"), prompt)
        assert_prompt_logprobs_match(carrying[0].prompt_logprobs.entries(), expected, prompt, 1)


def test_prompt_logprobs_cross_the_wire_as_plain_numbers():
    scored = PromptLogprobs([5, 6], [-0.5, -1.25], [1, 3], [[5, 9], [2, 1]], [[-0.5, -2.0], [-0.25, -0.75]])
    delta = TokenDelta("r", [], None, "length", prompt_logprobs=scored)
    codec = MessageCodec()
    message = StepOutputs(rank=0, dp_rank=0, deltas=[delta], stats=WorkerStats(0, 1, 0, 100, 90, 0))
    decoded = codec.decode_to_front(codec.encode(message))
    assert decoded.deltas[0].prompt_logprobs == scored
    assert decoded.deltas[0].prompt_logprobs.entries()[2].top == {2: -0.25, 1: -0.75}


def test_the_front_keeps_the_first_deltas_prompt_logprobs():
    processor = OutputProcessor(None)
    processor.add("r", [5, 6], SamplingParams(max_tokens=2, prompt_logprobs=0))
    first = PromptLogprobs([6], [-0.5], [1], [[]], [[]])
    [output] = processor.process([TokenDelta("r", [7], prompt_logprobs=first)]).outputs
    assert output.prompt_logprobs == [None, PromptTokenLogprob(6, -0.5, {}, 1)]
    again = PromptLogprobs([6], [-9.0], [9], [[]], [[]])
    [output] = processor.process([TokenDelta("r", [8], finish_reason="length", prompt_logprobs=again)]).outputs
    assert output.finished and output.prompt_logprobs == [None, PromptTokenLogprob(6, -0.5, {}, 1)]


@pytest.mark.parametrize("bad, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=0, prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(max_tokens=0, min_tokens=1, prompt_logprobs=0), "min_tokens"),
])
def test_bad_prompt_logprobs_settings_name_the_field(bad, field):
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{field}="):
        SamplingParams(**bad).validate()   # admission's check (RequestLimits.check): construction checks nothing

