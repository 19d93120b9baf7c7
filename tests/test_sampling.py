"""Sampling: seeds reproduce, top-k / top-p bound the choice, stop strings and stop ids cut."""
import pytest
import torch

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.sampler import Sampler, apply_top_k_top_p
from moe_runtime.records.sequence import Sequence


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu") as engine:
        yield engine


def test_same_seed_reproduces_and_other_seeds_differ(llm):
    params = lambda seed: SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
    a = llm.generate(PROMPTS, params(1234))
    b = llm.generate(PROMPTS, params(1234))
    c = llm.generate(PROMPTS, params(99))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_seeded_request_is_independent_of_its_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    batched = llm.generate(PROMPTS, [greedy(), params, SamplingParams(max_tokens=5, temperature=1.0), greedy()])
    assert batched[1].token_ids == alone


def test_top_k_one_is_greedy(llm):
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]


def test_sampled_tokens_stay_in_the_top_k(llm):
    k = 3
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=2.0, top_k=k, seed=5, logprobs=k,
                                                ignore_eos=True))
    for out in outs:
        for step in out.logprobs:
            assert step.token_id in step.top, "sampled token outside the top-k"


def _fake_seqs(params, n):
    return [Sequence(f"s{i}", [1], params, arrival=i) for i in range(n)]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    masked = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.85]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, True, False]
    masked = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(masked[0]).tolist() == [True, False, False, False]


def test_sampler_draws_only_inside_top_p_and_covers_it():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = probs.log()[None].repeat(400, 1)
    seqs = _fake_seqs(SamplingParams(temperature=1.0, top_p=0.75), 400)
    drawn = set(Sampler()(logits, seqs).token_ids)
    assert drawn == {0, 1, 2}


def test_stop_string_cuts_text(llm):
    [free] = llm.generate([PROMPTS[3]], greedy(24))
    text = free.text
    assert len(text) > 6, f"need some text to cut: {text!r}"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    [cut] = llm.generate([PROMPTS[3]], greedy(24, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert stop not in cut.text


def test_stop_token_ids_end_generation(llm):
    [free] = llm.generate([PROMPTS[0]], greedy(20))
    stop_id = free.token_ids[4]
    [cut] = llm.generate([PROMPTS[0]], greedy(20, stop_token_ids=[stop_id]))
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert cut.finish_reason == "stop"


def test_greedy_logprobs_pick_the_top_token(llm):
    [out] = llm.generate([PROMPTS[1]], greedy(8, logprobs=2))
    assert len(out.logprobs) == 8
    for step in out.logprobs:
        assert max(step.top, key=step.top.get) == step.token_id
        assert step.logprob == pytest.approx(step.top[step.token_id])
        assert step.logprob <= 0


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(logprobs=50), "logprobs"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_name_the_parameter(llm, kwargs, name):
    # refused at admission (construction checks nothing), before any work is queued
    with pytest.raises(InvalidRequestError, match=name):
        llm.generate([PROMPTS[0]], SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()


def test_bad_prompts_are_rejected_clearly(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], greedy())
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[10**7]], greedy())
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=10**6))
