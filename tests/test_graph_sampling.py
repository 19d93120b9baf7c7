"""Sampling inside the captured decode step (sampling/graph_sampling.py): the same tokens as the eager sampler
from the same logits (greedy, seeded temperature/top-k/top-p/min-p, penalties), compiled by inductor too; the
per-batch choice between the graph and the eager sampler; and engines whose captured steps sample in the
graph giving the eager engine's tokens for the same seeds."""
import pytest
import torch

from engine_helpers import PROMPTS
from moe_runtime import LLM
from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.graph_sampling import GraphSampling, GraphSamplingKind, sample_in_graph
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.sampler import Sampler
from moe_runtime.sampling.structured_output.grammar_state import GrammarState

VOCAB = 300


def _seq(index: int, **params) -> Sequence:
    prompt = [(7 * index + 3 * j) % VOCAB for j in range(5 + index)]
    seq = Sequence(f"r{index}", prompt, SamplingParams(max_tokens=64, **params), arrival=0)
    seq.output_token_ids = [(11 * index + 5 * j) % VOCAB for j in range(index % 4)]
    return seq


MIXED = [dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=1.3, top_k=20, seed=2),
         dict(temperature=0.7, top_p=0.6, seed=3), dict(temperature=1.0, min_p=0.2, seed=4),
         dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, seed=5), dict(temperature=0.0, top_k=3)]
PENALIZED = [dict(temperature=0.9, seed=6, repetition_penalty=1.3), dict(temperature=0.0, frequency_penalty=0.8),
             dict(temperature=1.1, seed=7, presence_penalty=-0.5, frequency_penalty=0.3),
             dict(temperature=0.0, repetition_penalty=0.7)]


def _graph_tokens(fn, seqs: list[Sequence], logits: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
    """The graph's tokens and statuses of `seqs` from `logits` padded to `rows` rows."""
    padded = torch.nn.functional.pad(logits, (0, 0, 0, rows - len(seqs)))                 # [rows, V]
    positions = torch.tensor([seq.num_tokens - 1 for seq in seqs] + [0] * (rows - len(seqs)))
    graph = GraphSampling.of(seqs, rows, VOCAB, torch.device("cpu"))
    tokens, status = fn(padded, positions, *graph.tensors)[:, :len(seqs)].tolist()
    return tokens, status


def _cases():
    torch.manual_seed(0)
    for params, steps in ((MIXED, 6), (PENALIZED + MIXED[:3], 4)):
        for step in range(steps):
            seqs = [_seq(i, **p) for i, p in enumerate(params)]
            for seq in seqs:   # later positions: the seeded draws move on
                seq.output_token_ids += [step] * step
            yield seqs, torch.randn(len(seqs), VOCAB) * (1 + step)


def test_the_graph_draws_the_eager_samplers_tokens_from_the_same_logits():
    sampler = Sampler()
    for seqs, logits in _cases():
        expected = sampler(logits, seqs)
        tokens, status = _graph_tokens(sample_in_graph, seqs, logits, rows=8 if len(seqs) <= 8 else 16)
        assert tokens == expected.token_ids and status == [0] * len(seqs)


def test_inductors_compiled_sampling_draws_the_same_tokens():
    """What the AOT library runs: inductor's C++ for the sort, cumsum, hash and race, each kind compiled once."""
    compiled = torch.compile(sample_in_graph, fullgraph=True, dynamic=False)
    sampler = Sampler()
    for seqs, logits in _cases():
        tokens, _ = _graph_tokens(compiled, seqs, logits, rows=8)
        assert tokens == sampler(logits, seqs).token_ids


def test_a_row_without_a_usable_token_gets_the_eager_samplers_error_status():
    seqs = [_seq(0, temperature=0.0), _seq(1, temperature=1.0, seed=3), _seq(2, temperature=1.0, seed=4)]
    logits = torch.randn(3, VOCAB)
    logits[0] = float("nan")
    logits[2] = float("-inf")
    expected = Sampler()(logits, seqs)
    tokens, status = _graph_tokens(sample_in_graph, seqs, logits, rows=4)
    assert status[0] == 1 and status[2] == 2 and status[1] == 0          # LOGITS_NOT_FINITE, NO_TOKEN_ALLOWED
    assert tokens[1] == expected.token_ids[1] and expected.errors[0] and expected.errors[2]


def test_the_kind_is_the_cheapest_graph_that_covers_the_batch():
    assert GraphSampling.kind_of([_seq(0, temperature=0.0), _seq(1, temperature=0.0)]) is GraphSamplingKind.GREEDY
    assert GraphSampling.kind_of([_seq(0, temperature=0.0), _seq(1, top_p=0.5)]) is GraphSamplingKind.SAMPLED
    assert GraphSampling.kind_of([_seq(0, temperature=0.0, presence_penalty=0.1),
                                  _seq(1, top_p=0.5)]) is GraphSamplingKind.PENALIZED
    graph = GraphSampling.of([_seq(0, top_k=-1, temperature=0.5)], 4, VOCAB, torch.device("cpu"))
    greedy, temperature, top_k = graph.tensors[:3]
    assert greedy.tolist() == [False, True, True, True] and temperature.tolist() == [0.5, 1.0, 1.0, 1.0]
    assert top_k.tolist() == [0, 0, 0, 0]                                 # pad rows: greedy, neutral


@pytest.mark.parametrize("params, reason", [
    (dict(logprobs=2), "logprobs"), (dict(logit_bias={3: 1.0}), "logit_bias"),
    (dict(min_tokens=10), "min_tokens")])
def test_features_the_graph_does_not_cover_keep_the_eager_sampler_for_the_batch(params, reason):
    plain = [_seq(0, temperature=0.5, seed=1), _seq(1, temperature=0.0)]
    assert GraphSampling.refusal(plain) is None
    assert GraphSampling.refusal(plain + [_seq(2, **params)]) == reason


def test_grammars_and_drafts_keep_the_eager_sampler():
    constrained = _seq(0)
    constrained.grammar = GrammarState.__new__(GrammarState)
    assert GraphSampling.refusal([_seq(1), constrained]) == "structured output"
    verifying = _seq(2)
    verifying.drafts.token_ids = [4, 5]
    assert GraphSampling.refusal([verifying]) == "a row verifies drafts"
    done = _seq(3, min_tokens=1)
    done.output_token_ids = [1, 2]
    assert GraphSampling.refusal([done]) is None                          # min_tokens already reached


ENGINE_PARAMS = [dict(temperature=0.9, top_k=40, seed=11), dict(temperature=0.0),
                 dict(temperature=1.2, top_p=0.8, seed=12, repetition_penalty=1.2),
                 dict(temperature=0.7, min_p=0.1, seed=13, frequency_penalty=0.5, presence_penalty=0.2)]


def _generate(llm, logprobs_row: bool = False):
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **p) for p in ENGINE_PARAMS]
    if logprobs_row:
        params[1] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def eager_tokens(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu", dtype="float32") as llm:
        return _generate(llm), _generate(llm, logprobs_row=True)


def test_captured_steps_sample_in_the_graph_and_give_the_eager_engines_tokens(tiny_checkpoint_factory, eager_tokens):
    """Seeded sampling, greedy and penalties in one batch (the PENALIZED graph), then a batch with a logprobs row,
    which the eager sampler samples from the captured step's logits: the eager engine's tokens both times."""
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu", dtype="float32", enable_torch_compile=True,
             torch_compile_backend="eager") as llm:
        stats = llm.core.runner.capture.stats
        assert _generate(llm) == eager_tokens[0]
        sampled_in_graph = stats.graph_sampled_steps
        assert sampled_in_graph == stats.captured_steps > 0
        assert (4, "penalized") in stats.graphs_compiled
        assert _generate(llm, logprobs_row=True) == eager_tokens[1]
        assert stats.graph_sampled_steps == sampled_in_graph              # that batch: the eager sampler
        assert stats.captured_steps > sampled_in_graph
