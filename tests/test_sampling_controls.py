"""Sampling controls: presence/frequency/repetition penalties, min_p, logit_bias, min_tokens, stop_token_ids.

- against a direct computation: the sampler's batched logits processing equals a plain per-row loop
  written from the definitions (OpenAI's penalties over output tokens, transformers' repetition rule
  over prompt + output, logit_bias added, min_tokens banning stop tokens), and min_p drops exactly
  the tokens below min_p x the top probability after temperature;
- against transformers: greedy tokens with repetition_penalty equal `generate(repetition_penalty=x,
  do_sample=False)` on a tiny checkpoint;
- end to end in the engine: min_tokens holds EOS and stop tokens back, logit_bias steers, seeded
  requests with penalties reproduce and do not depend on their batch;
- bounds: each parameter out of range is refused naming it; token ids outside the vocabulary too.
"""
from __future__ import annotations

import math

import pytest
import torch
from tiny_checkpoints import HFOracle

from moe_runtime.attention_dp.messages import AddRequest, MessageCodec
from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.errors import InvalidRequestError
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.sampling.sampler import Sampler
from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec

EOS = (1, 4)
VOCAB = 40


# ---- the definitions, one row at a time ------------------------------------------------------

def reference_row(logits: torch.Tensor, seq: Sequence, eos: tuple[int, ...]) -> torch.Tensor:
    """One row's processed logits [V], computed token by token from the definitions."""
    p = seq.params
    row = logits.clone()
    if len(seq.output_token_ids) < p.min_tokens:
        banned = row.clone()
        for token in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)):
            banned[token] = -math.inf
        if torch.isfinite(banned).any():
            row = banned
    for token, bias in p.logit_bias.items():
        row[token] += bias
    if p.repetition_penalty != 1.0:
        for token in set(seq.prompt_token_ids) | set(seq.output_token_ids):
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(seq.output_token_ids):
        count = seq.output_token_ids.count(token)
        row[token] -= p.frequency_penalty * count + p.presence_penalty
    return row


def make_seq(i: int, prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence(f"s{i}", prompt, SamplingParams(max_tokens=50, **params), arrival=i)
    seq.output_token_ids = list(output)
    return seq


MIXED_BATCH = [
    dict(prompt=[3, 5, 5, 9], output=[5, 7, 7, 7, 2], params=dict(presence_penalty=0.7)),
    dict(prompt=[3, 5, 9], output=[5, 7, 7, 7, 2], params=dict(frequency_penalty=-1.3)),
    dict(prompt=[10, 11, 12, 13], output=[13, 20, 20], params=dict(repetition_penalty=1.8)),
    dict(prompt=[10, 11, 12, 13], output=[13, 20, 20], params=dict(repetition_penalty=0.4, presence_penalty=-2.0,
                                                                   frequency_penalty=2.0)),
    dict(prompt=[6], output=[], params=dict(logit_bias={6: 100.0, 30: -100.0, 31: 0.5})),
    dict(prompt=[6], output=[8], params=dict(min_tokens=3, stop_token_ids=[17, 18])),
    dict(prompt=[6], output=[8], params=dict(min_tokens=3, ignore_eos=True, stop_token_ids=[17])),
    dict(prompt=[6], output=[8, 9, 10], params=dict(min_tokens=3, stop_token_ids=[17])),   # min_tokens reached
    dict(prompt=[1, 2], output=[2, 2], params=dict()),                                       # nothing asked
]


def mixed_batch() -> list[Sequence]:
    return [make_seq(i, case["prompt"], case["output"], **case["params"]) for i, case in enumerate(MIXED_BATCH)]


def test_batched_processing_equals_the_definitions_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED_BATCH), VOCAB) * 3                      # positive and negative logits
    seqs = mixed_batch()
    before = logits.clone()
    processed = Sampler(EOS).process(logits, seqs)
    expected = torch.stack([reference_row(logits[i], seq, EOS) for i, seq in enumerate(seqs)])
    torch.testing.assert_close(processed.logits, expected)
    assert processed.errors == [None] * len(seqs)
    assert torch.equal(logits, before), "processing must not change the logits it was given"


def test_each_row_is_processed_as_it_would_be_alone():
    torch.manual_seed(1)
    logits = torch.randn(len(MIXED_BATCH), VOCAB)
    seqs = mixed_batch()
    batched = Sampler(EOS).process(logits, seqs).logits
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(batched[i:i + 1], Sampler(EOS).process(logits[i:i + 1], [seq]).logits)


def test_min_tokens_ban_yields_when_stopping_is_all_that_is_left():
    logits = torch.full((1, VOCAB), -math.inf)
    logits[0, EOS[0]] = 2.0                                                  # e.g. a complete grammar: only EOS
    seq = make_seq(0, [5], [], min_tokens=4)
    processed = Sampler(EOS).process(logits, [seq])
    assert processed.errors == [None] and int(processed.logits.argmax()) == EOS[0]


def test_a_row_with_every_token_forbidden_fails_alone():
    logits = torch.zeros(2, VOCAB)
    logits[1] = -math.inf
    result = Sampler(EOS)(logits, [make_seq(0, [5], []), make_seq(1, [5], [])])
    assert result.errors[0] is None and "no token is allowed" in result.errors[1]


def min_p_reference(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    probs = (logits / temperature).softmax(dim=-1)
    kept = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return kept / kept.sum()


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.1), (0.5, 0.3), (2.0, 0.05), (1.0, 1.0), (0.7, 0.0)])
def test_min_p_keeps_the_tokens_at_or_above_min_p_times_the_top_probability(temperature, min_p):
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB) * 2
    seq = make_seq(0, [5], [], temperature=temperature, min_p=min_p)
    probs = Sampler.sampling_probs(logits, [seq], [0])[0]
    torch.testing.assert_close(probs, min_p_reference(logits[0], temperature, min_p))


def test_sampled_tokens_respect_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03]])).repeat(300, 1)
    seqs = [make_seq(i, [1], [], temperature=1.0, min_p=0.2) for i in range(300)]
    drawn = set(Sampler()(logits, seqs).token_ids)
    assert drawn == {0, 1, 2}        # 0.12 >= 0.2 * 0.5, 0.05 < 0.1


def test_logit_bias_plus_and_minus_100_force_and_ban():
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB)
    top = int(logits[1].argmax())
    seqs = [make_seq(0, [5], [], temperature=0.0, logit_bias={7: 100}),
            make_seq(1, [5], [], temperature=0.0, logit_bias={top: -100})]
    tokens = Sampler()(logits, seqs).token_ids
    assert tokens[0] == 7 and tokens[1] != top


# ---- bounds ----------------------------------------------------------------------------------

REFUSED = [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=math.inf), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=1e-9), "repetition_penalty"),
    (dict(repetition_penalty=101.0), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={3: 100.5}), "logit_bias"),
    (dict(logit_bias={3: math.nan}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"3": 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
    (dict(logit_bias=[3]), "logit_bias"),
    (dict(structured_output={"regex": "a"}), "structured_output"),
]


@pytest.mark.parametrize("kwargs, param", REFUSED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
def test_out_of_range_controls_are_refused_naming_the_parameter(kwargs, param):
    limits = RequestLimits(vocab_size=2000, max_model_len=100, kv_capacity_tokens=1000)
    with pytest.raises(InvalidRequestError, match=rf"^SamplingParams\.{param}[=:]"):
        limits.check([1, 2], SamplingParams(**kwargs))   # at admission: construction checks nothing


def test_the_limits_refuse_logit_bias_tokens_outside_the_vocabulary():
    limits = RequestLimits(vocab_size=10, max_model_len=100, kv_capacity_tokens=1000)
    limits.check([1, 2], SamplingParams(logit_bias={9: -100}))
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.logit_bias=.*outside the vocabulary"):
        limits.check([1, 2], SamplingParams(logit_bias={3: 1.0, 10: -1.0}))


def test_every_control_crosses_the_control_plane_intact():
    codec = MessageCodec()
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3, min_p=0.05,
                            logit_bias={5: -100, 7: 2.5}, min_tokens=3, stop_token_ids=[9], seed=4,
                            structured_output=StructuredOutputSpec(json_schema='{"type": "object"}'))
    message = AddRequest(request_id="r", prompt_token_ids=[1, 2], params=params, dp_rank=0)
    decoded = codec.decode_to_rank(codec.encode(message))
    assert decoded.params == params
    assert isinstance(decoded.params.structured_output, StructuredOutputSpec)


# ---- in the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), device="cpu", max_num_seqs=8) as engine:
        yield engine


def hf_greedy_with_repetition_penalty(model, prompts: list[list[int]], new_tokens: int, penalty: float):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=None, repetition_penalty=penalty, pad_token_id=model.config.pad_token_id)
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])                                                   # [1, T]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            results.append(out[0, ids.shape[1]:].tolist())
    return results


@pytest.mark.parametrize("penalty", [1.6, 0.6])
def test_greedy_with_repetition_penalty_equals_transformers_generate(llm, checkpoint, penalty):
    oracle = HFOracle(checkpoint)
    prompts = PROMPTS[:3]
    expected = hf_greedy_with_repetition_penalty(oracle.model, prompts, 16, penalty)
    ours = [o.token_ids for o in llm.generate(prompts, greedy(16, repetition_penalty=penalty))]
    assert ours == expected
    assert ours != [o.token_ids for o in llm.generate(prompts, greedy(16))], "the penalty changed nothing here"


def test_min_tokens_holds_eos_back_and_logit_bias_then_ends_at_once(llm):
    eos = sorted(llm.core.eos_ids)[0]
    pushed = dict(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0})
    [at_once] = llm.generate([PROMPTS[0]], SamplingParams(**pushed))
    [held] = llm.generate([PROMPTS[0]], SamplingParams(**pushed, min_tokens=5))
    assert at_once.token_ids == [eos] and at_once.finish_reason == "stop"
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5] and held.token_ids[5] == eos
    assert held.finish_reason == "stop"


def test_min_tokens_holds_stop_token_ids_back(llm):
    stop = 77
    [held] = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                       logit_bias={stop: 100.0}, stop_token_ids=[stop], min_tokens=3))
    assert held.token_ids[:3] != [stop] * 3 and stop not in held.token_ids[:3]
    assert held.token_ids[3:] == [stop] and held.finish_reason == "stop"


def test_penalties_change_greedy_output_as_their_definition_says(llm):
    [free] = llm.generate([PROMPTS[3]], greedy(24))
    [penalized] = llm.generate([PROMPTS[3]], greedy(24, frequency_penalty=2.0, presence_penalty=2.0))
    repeats = lambda tokens: len(tokens) - len(set(tokens))
    assert repeats(free.token_ids) > 0, "need a free run that repeats itself"
    assert repeats(penalized.token_ids) < repeats(free.token_ids)


def test_seeded_requests_with_every_control_reproduce_and_ignore_their_batch(llm):
    eos = sorted(llm.core.eos_ids)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=21, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2, min_p=0.05, logit_bias={eos: -100, 42: 3.0}, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    batched = llm.generate(PROMPTS, [greedy(), params, SamplingParams(max_tokens=5, repetition_penalty=1.5),
                                     greedy(frequency_penalty=1.0)])
    assert batched[1].token_ids == alone
    assert llm.generate([PROMPTS[1]], params)[0].token_ids == alone
