"""`logprobs_mode` (vLLM's `--logprobs-mode`): what a sampled token's logprob and its alternatives are.

Held against a reference written here from the definitions, one row at a time, on the same logits: the
penalties and logit_bias (OpenAI's and transformers' rules), then, for a sampled request, temperature, min-p,
top-k and top-p, and a log-softmax for the logprob modes. `processed_logprobs` is then the log of the
probability each token was drawn with (an RL trainer's old-policy logprob); `raw_logprobs` stays the
model's; the tokens drawn do not depend on the mode. In the engine: a tiny MoE's sampled and greedy tokens
report the processed logprobs of the engine's own logits at each position.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine_helpers import runtime_prefill_logits
from moe_runtime import LLM, SamplingParams
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.config.logprobs_mode import LOGPROBS_MODES, LogprobsMode
from moe_runtime.sampling.sampler import Sampler
from moe_runtime.server.cli import build_parser, engine_config_from_args
from moe_runtime.server.logprobs import LOWEST_SHOWN_LOGPROB, TokenNamer, chat_logprobs, completion_logprobs
from moe_runtime.speculative.verification import VerifyingSampler

VOCAB = 48
NUM_TOP = 3     # alternatives asked: fewer than every row's surviving tokens, so no -inf ties among them

ROW_PARAMS = [
    dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),           # greedy, penalized
    dict(temperature=0.7, top_k=6, frequency_penalty=0.4, logit_bias={3: 2.0}),
    dict(temperature=1.3, top_p=0.8, repetition_penalty=0.8),
    dict(temperature=0.9, min_p=0.05, top_k=12, top_p=0.95, presence_penalty=1.0),
    dict(temperature=1.0),                                                          # nothing but the draw
]


def processed_reference(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The logits [V] one row's token is chosen from, by the definitions, one token at a time."""
    p = seq.params
    row = logits.clone().double()
    for token, bias in p.logit_bias.items():
        row[token] += bias
    for token in set(seq.prompt_token_ids) | set(seq.output_token_ids):
        if p.repetition_penalty != 1.0:
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(seq.output_token_ids):
        row[token] -= p.frequency_penalty * seq.output_token_ids.count(token) + p.presence_penalty
    if p.greedy:
        return row
    row = row / p.temperature
    probs = row.softmax(dim=-1)
    alive = [t for t in range(len(row)) if probs[t] >= p.min_p * probs.max()]                  # min-p
    alive.sort(key=lambda t: -float(row[t]))
    if p.top_k > 0:
        alive = alive[: p.top_k]                                                                # top-k
    survivors_mass = float(sum(probs[t] for t in alive))
    kept, mass_before = [], 0.0
    for token in alive:                                      # top-p over the survivors, the best always kept
        if kept and mass_before >= p.top_p:
            break
        kept.append(token)
        mass_before += float(probs[token]) / survivors_mass
    dropped = torch.ones(len(row), dtype=torch.bool)
    dropped[kept] = False
    return row.masked_fill(dropped, -math.inf)


def reference_scores(logits: torch.Tensor, seq: Sequence, mode: LogprobsMode) -> torch.Tensor:
    scores = processed_reference(logits, seq) if mode.processed else logits.double()
    return scores.log_softmax(dim=-1) if mode.normalized else scores


def sequences() -> list[Sequence]:
    seqs = []
    for i, params in enumerate(ROW_PARAMS):
        seq = Sequence(f"s{i}", [5, 9, 3, 9], SamplingParams(max_tokens=20, seed=100 + i, logprobs=NUM_TOP, **params),
                       arrival=i)
        seq.output_token_ids = [3, 7, 7, 11, 3, 7]
        seqs.append(seq)
    return seqs


def assert_logprobs_match(logprob, expected: torch.Tensor, where: str) -> None:
    """One `TokenLogprob` against the reference scores [V] of its row."""
    assert logprob.logprob == pytest.approx(float(expected[logprob.token_id]), abs=2e-5), where
    best = expected.topk(NUM_TOP)
    assert list(logprob.top) == best.indices.tolist(), where
    assert list(logprob.top.values()) == pytest.approx(best.values.tolist(), abs=2e-5), where


def test_every_mode_reports_its_own_scores_and_draws_the_same_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROW_PARAMS), VOCAB, generator=generator) * 3                     # [B, V]
    seqs = sequences()
    drawn = {mode: Sampler(eos_token_ids=(1,), logprobs_mode=mode)(logits, seqs) for mode in LogprobsMode}
    tokens = drawn[LogprobsMode.RAW_LOGPROBS].token_ids
    assert tokens[0] == int(processed_reference(logits[0], seqs[0]).argmax())                 # greedy after penalties
    for mode, result in drawn.items():
        assert result.token_ids == tokens, f"{mode.value} changed the draw"
        assert result.errors == [None] * len(seqs)
        for row, (logprob, seq) in enumerate(zip(result.logprobs, seqs)):
            assert_logprobs_match(logprob, reference_scores(logits[row], seq, mode), f"{mode.value} row {row}")
    processed = drawn[LogprobsMode.PROCESSED_LOGPROBS].logprobs
    sampled_rows = list(range(1, len(seqs)))
    penalized = Sampler(eos_token_ids=(1,)).process(logits, seqs).logits                      # [B, V]
    probs = Sampler.sampling_probs(penalized, seqs, sampled_rows)                             # what was drawn from
    for j, row in enumerate(sampled_rows):
        assert math.exp(processed[row].logprob) == pytest.approx(float(probs[j, tokens[row]]), rel=1e-5)
    raw = drawn[LogprobsMode.RAW_LOGPROBS].logprobs
    assert any(abs(raw[row].logprob - processed[row].logprob) > 0.05 for row in range(len(seqs)))


def test_processed_alternatives_past_the_top_k_are_minus_infinity():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    seq = Sequence("s", [2], SamplingParams(max_tokens=4, temperature=0.8, top_k=2, seed=3, logprobs=4), arrival=0)
    logprob = Sampler(logprobs_mode="processed_logprobs")(logits, [seq]).logprobs[0]
    values = list(logprob.top.values())
    assert values[2:] == [-math.inf, -math.inf] and sum(math.exp(v) for v in values) == pytest.approx(1.0)
    assert logprob.token_id in list(logprob.top)[:2]


def test_an_unknown_mode_is_refused_naming_the_flag():
    with pytest.raises(EngineConfigError, match="--logprobs-mode 'processed'"):
        EngineConfig(model="m", logprobs_mode="processed").validate_options()
    config = engine_config_from_args(build_parser().parse_args(["--logprobs-mode", "processed_logits"]))
    assert config.logprobs_mode == "processed_logits" and set(LOGPROBS_MODES) == {m.value for m in LogprobsMode}


@pytest.fixture(scope="module")
def processed_engine(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu", dtype="float32",
             logprobs_mode="processed_logprobs") as engine:
        yield engine


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.3, seed=11),
    dict(temperature=0.0, frequency_penalty=0.7),
], ids=["sampled", "greedy"])
def test_the_engine_reports_the_processed_logprobs_of_its_logits(processed_engine, params):
    prompt = [5, 17, 42, 99, 3, 17]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=NUM_TOP, **params)
    out = processed_engine.generate([prompt], params)[0]
    core = processed_engine.core
    for i, logprob in enumerate(out.logprobs):
        seq = Sequence("reference", prompt, params, arrival=0)
        seq.output_token_ids = list(out.token_ids[:i])
        logits = runtime_prefill_logits(core, prompt + out.token_ids[:i])[-1]                # [V] at that step
        expected = reference_scores(logits, seq, LogprobsMode.PROCESSED_LOGPROBS)
        assert logprob.token_id == out.token_ids[i]
        assert math.isfinite(logprob.logprob), "a token was drawn where its processed probability is 0"
        assert_logprobs_match(logprob, expected, f"token {i}")
        if params.greedy:
            assert out.token_ids[i] == int(expected.argmax())


def test_dropped_alternatives_cross_http_as_vllms_floor():
    """JSON has no -inf (a plain answer's encoder refuses it): a dropped alternative shows -9999.0, as vLLM's."""
    entry = TokenLogprob(4, -0.5, {4: -0.5, 9: -1.0, 2: -math.inf})
    namer = TokenNamer(None)
    completion = completion_logprobs([entry], namer, 0)
    chat = chat_logprobs([entry], namer)
    assert completion.top_logprobs[0]["token_id:2"] == LOWEST_SHOWN_LOGPROB == -9999.0
    assert chat.content[0].top_logprobs[-1].logprob == LOWEST_SHOWN_LOGPROB
    json.dumps([completion.model_dump(mode="json"), chat.model_dump(mode="json")], allow_nan=False)


def test_verified_drafts_report_the_processed_logprobs_of_their_rows():
    """Speculative decoding: each accepted draft's and the emitted token's value is read from its own logits row,
    processed as the sequence stands there (the drafts before it in its output: the penalties see them)."""
    drafts = [9, 4]
    logits = torch.randn(2 * (1 + len(drafts)), VOCAB, generator=torch.Generator().manual_seed(2))   # [R, V]
    for row, draft in enumerate(drafts * 2):
        logits[row + row // len(drafts), draft] += 12.0                   # each draft far ahead in its row
    seqs = []
    for i, params in enumerate([dict(temperature=0.0, presence_penalty=1.5),
                                dict(temperature=0.8, top_k=6, frequency_penalty=0.7, seed=5)]):
        seq = Sequence(f"d{i}", [5, 9, 3], SamplingParams(max_tokens=8, logprobs=NUM_TOP, **params), arrival=i)
        seq.output_token_ids, seq.drafts.token_ids = [4, 11], list(drafts)
        seqs.append(seq)
    result = VerifyingSampler(Sampler(logprobs_mode="processed_logprobs"), None)(logits, seqs)
    for i, (seq, accepted, token, logprob) in enumerate(zip(seqs, result.accepted_rows(), result.token_ids,
                                                           result.logprobs)):
        assert [t for t, _ in accepted] == drafts, "the drafts were meant to be accepted"
        for j, (emitted, entry) in enumerate([*accepted, (token, logprob)]):
            view = Sequence("view", seq.prompt_token_ids, seq.params, arrival=0)
            view.output_token_ids = seq.output_token_ids + drafts[:j]
            expected = reference_scores(logits[i * (1 + len(drafts)) + j], view, LogprobsMode.PROCESSED_LOGPROBS)
            assert entry.token_id == emitted
            assert_logprobs_match(entry, expected, f"sequence {i}, emitted {j}")
