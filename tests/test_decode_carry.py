"""The carried decode batch (moe_runtime/execution/decode_carry.py): a steady captured batch's next inputs come from
the previous step's graph, and the tokens stay transformers' (greedy) and the eager sampler's (seeded).

The engines trace with torch.compile's "eager" backend (the carry is the point, not inductor's code) and a block
size of 4, so sequences cross block boundaries every few steps (the AOTInductor library's carried steps are counted
in test_captured_decode.py's inductor test, beside its other checks of that library). `DecodeCarry` itself is
checked on hand-made sequences: every mismatch falls back.
"""
from dataclasses import dataclass

import pytest
import torch

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.execution.decode_carry import DecodeCarry, PaddedStep
from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.graph_sampling import GraphSampling, GraphSamplingKind

ARCH = "qwen3_moe"
NEW_TOKENS = 20    # the parity tests' length: the oracle's cached tokens are reused
BLOCK = 4
SCRATCH = 99 * BLOCK


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory(ARCH)), device="cpu", dtype="float32", block_size=BLOCK,
             enable_torch_compile=True, torch_compile_backend="eager", torch_compile_max_bs=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def eager(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory(ARCH)), device="cpu", dtype="float32", block_size=BLOCK) as llm:
        yield llm


def stats(llm):
    return llm.core.runner.capture.stats


@dataclass
class StepRecord:
    ids: list[str]          # the step's requests, in order
    one_token: bool         # every one computes one token and samples (decodes; a prompt cached but its last token)
    captured: bool
    carried: bool


def record_steps(llm, monkeypatch) -> list[StepRecord]:
    """Each step the runner runs, as it ran (recorded around `ModelRunner._execute`)."""
    runner, steps = llm.core.runner, []
    execute = runner._execute

    def recording(seqs, graph_sampling):
        before = (stats(llm).captured_steps, stats(llm).carried_steps)
        one_token = all(seq.num_scheduled_tokens == 1 and seq.samples_this_step for seq in seqs)
        ids = [seq.request_id for seq in seqs]
        step = execute(seqs, graph_sampling)
        steps.append(StepRecord(ids, one_token, stats(llm).captured_steps > before[0],
                                stats(llm).carried_steps > before[1]))
        return step

    monkeypatch.setattr(runner, "_execute", recording)
    return steps


def test_a_steady_greedy_batch_carries_every_step_after_the_first(compiled, greedy_oracle):
    """Four sequences decode in bucket 4, crossing block boundaries: every decode step but the first takes its
    inputs from the previous step's graph, and the tokens are transformers'."""
    before = (stats(compiled).captured_steps, stats(compiled).carried_steps)
    outputs = compiled.generate(PROMPTS, greedy(NEW_TOKENS))
    assert [o.token_ids for o in outputs] == greedy_oracle(ARCH, PROMPTS, NEW_TOKENS)
    assert stats(compiled).captured_steps - before[0] == NEW_TOKENS - 1
    assert stats(compiled).carried_steps - before[1] == NEW_TOKENS - 2
    worker = compiled.engine.stats().workers[0]
    assert worker.carried_decode_steps == stats(compiled).carried_steps > 0


def test_seeded_sampling_carries_and_draws_the_eager_samplers_tokens(compiled, eager, greedy_oracle):
    """Seeded rows beside greedy ones (the graph's sampled kind, its parameter tensors carried too): the eager
    engine's tokens. A batch whose tokens the host samples (logprobs) never carries."""
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.85, top_k=50, seed=seed)
              for seed in range(2)] + [greedy(12), greedy(12)]
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]
    before = stats(compiled).carried_steps
    assert [o.token_ids for o in compiled.generate(PROMPTS, params)] == expected
    assert stats(compiled).carried_steps - before == 12 - 2
    assert (4, GraphSamplingKind.SAMPLED.value) in stats(compiled).graphs_compiled

    before = stats(compiled).carried_steps
    outputs = compiled.generate(PROMPTS, greedy(8, logprobs=1))
    assert [o.token_ids for o in outputs] == greedy_oracle(ARCH, PROMPTS, 8)
    assert stats(compiled).carried_steps == before


def test_penalized_sampling_carries_its_token_counts_one_token_on(compiled, eager):
    """The penalized kind's output counts change with every token: a carried step adds each penalized row's drawn
    token to the kept counts (a row without penalties keeps zero counts), and the draws stay the eager sampler's,
    which counts the outputs again every step. Frequency penalties make every repeated token count."""
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.5, seed=seed, repetition_penalty=1.3,
                             frequency_penalty=2.0) for seed in range(len(PROMPTS) - 2)]
    params.append(SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, presence_penalty=2.0))
    params.append(SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]
    before = (stats(compiled).graph_sampled_steps, stats(compiled).carried_steps)
    assert [o.token_ids for o in compiled.generate(PROMPTS, params)] == expected
    assert stats(compiled).graph_sampled_steps - before[0] == 12 - 1
    assert stats(compiled).carried_steps - before[1] == 12 - 2


def test_a_changing_batch_restarts_the_carry_and_keeps_the_oracle_tokens(compiled, greedy_oracle, monkeypatch):
    """Sequences finishing early, one joining mid-way (a mixed step, or, its prompt cached by an earlier test, a
    one-token step), and block boundaries: a step carries exactly when it computes one token for each sequence of
    the previous step, which the capture ran the same way, and the tokens are transformers'."""
    lengths = [NEW_TOKENS, 7, 12, 9]
    expected = [tokens[:n] for tokens, n in zip(greedy_oracle(ARCH, PROMPTS, NEW_TOKENS), lengths)]
    steps = record_steps(compiled, monkeypatch)
    engine, tokens, count = compiled.engine, {}, 0
    for index in range(3):
        engine.add_request(f"c{index}", PROMPTS[index], greedy(lengths[index]))
    while engine.has_unfinished() or count == 0:
        if count == 5:
            engine.add_request("c3", PROMPTS[3], greedy(lengths[3]))
        for out in engine.step():
            tokens[out.request_id] = list(out.token_ids)
        count += 1
    assert [tokens[f"c{i}"] for i in range(4)] == expected
    for previous, step in zip(steps, steps[1:]):
        steady = previous.one_token and previous.captured and step.one_token and step.ids == previous.ids
        assert step.carried == steady, (previous, step)
    changes = [i for i in range(1, len(steps)) if steps[i].ids != steps[i - 1].ids]
    assert len(changes) >= 3                                   # the join, and finishes
    assert all(steps[i + 1].carried for i in changes[1:] if i + 1 < len(steps) and steps[i + 1].ids == steps[i].ids)
    assert sum(step.carried for step in steps) >= NEW_TOKENS - 8


def test_a_sliding_window_model_carries_and_stays_exact(tiny_checkpoint_factory):
    """Mistral with a window of 8 generating well past it (the windowed rows' first keys come from the carried
    context lengths): the eager engine's tokens."""
    path, new_tokens = str(tiny_checkpoint_factory("mistral", sliding_window=8)), 16
    with LLM(path, device="cpu", dtype="float32", block_size=BLOCK) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, greedy(new_tokens))]
    with LLM(path, device="cpu", dtype="float32", block_size=BLOCK, enable_torch_compile=True,
             torch_compile_backend="eager") as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy(new_tokens))]
        carried = stats(llm).carried_steps
    assert got == expected
    assert carried == new_tokens - 2


# ---- DecodeCarry on hand-made sequences ---------------------------------------------------------------------

def _seq(index: int, cached: int, table: list[int], token: int) -> Sequence:
    """A sequence that has just sampled `token` with `cached` tokens in its cache: it decodes that token next."""
    seq = Sequence(f"s{index}", [1] * cached, greedy(), arrival=index)
    seq.output_token_ids = [token]
    seq.num_cached_tokens = cached
    seq.kv.block_table = list(table)
    return seq


def _kept(seqs: list[Sequence], tokens: list[int], bucket: int = 4) -> tuple[DecodeCarry, PaddedStep]:
    """A carry holding the next inputs of `seqs` (padded to `bucket`) as a graph would have computed them."""
    pad = bucket - len(seqs)
    positions = [seq.num_cached_tokens for seq in seqs]
    width = max(len(seq.kv.block_table) for seq in seqs)
    tables = torch.full((bucket, width), -1, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        tables[i, :len(seq.kv.block_table)] = torch.tensor(seq.kv.block_table, dtype=torch.int32)
    slots = [seq.kv.block_table[p // BLOCK] * BLOCK + p % BLOCK if p // BLOCK < len(seq.kv.block_table) else SCRATCH
             for seq, p in zip(seqs, positions)]
    step = PaddedStep(torch.tensor(tokens + [0] * pad), torch.tensor(positions + [0] * pad),
                      torch.tensor(slots + [SCRATCH] * pad), tables,
                      torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32),
                      GraphSampling(GraphSamplingKind.GREEDY, ()))
    carry = DecodeCarry(BLOCK, dynamic_width=True)
    carry.keep(seqs, step, tokens)
    for seq in seqs:
        seq.num_scheduled_tokens = 1
    return carry, step


def test_the_carry_hands_back_the_kept_step_for_the_same_batch_once():
    seqs = [_seq(0, 6, [3, 4], 11), _seq(1, 2, [7], 12)]
    carry, step = _kept(seqs, [11, 12])
    assert carry.take(seqs) is step
    assert carry.take(seqs) is None                             # used up


def test_a_row_that_gained_a_block_gets_it_and_its_slot_and_the_table_widens():
    seqs = [_seq(0, 8, [3, 4], 11), _seq(1, 3, [7], 12)]      # row 0's position 8 needs a third block
    carry, step = _kept(seqs, [11, 12])
    assert step.slot_mapping[0] == SCRATCH                      # the graph could not know it
    seqs[0].kv.block_table.append(9)
    taken = carry.take(seqs)
    assert taken.block_tables.shape == (4, 3) and taken.block_tables[0].tolist() == [3, 4, 9]
    assert taken.block_tables[1].tolist() == [7, -1, -1] and taken.block_tables[2].tolist() == [-1, -1, -1]
    assert taken.slot_mapping.tolist() == [9 * BLOCK, 7 * BLOCK + 3, SCRATCH, SCRATCH]
    assert taken.input_ids is step.input_ids and taken.positions is step.positions


@pytest.mark.parametrize("change", ["other token", "block replaced", "order", "one more", "drafts", "not decoding",
                                    "params", "preempted"])
def test_any_other_batch_falls_back(change):
    seqs = [_seq(0, 6, [3, 4], 11), _seq(1, 2, [7], 12)]
    carry, _ = _kept(seqs, [11, 12])
    if change == "other token":
        seqs[1].output_token_ids[-1] = 13
    elif change == "block replaced":
        seqs[0].kv.block_table[0] = 5
    elif change == "order":
        seqs.reverse()
    elif change == "one more":
        seqs.append(_seq(2, 2, [8], 1))
    elif change == "drafts":
        seqs[0].drafts.token_ids = [1]
        seqs[0].num_scheduled_tokens = 2
    elif change == "not decoding":
        seqs[0].num_cached_tokens -= 1
    elif change == "params":
        seqs[1].params = greedy()
    elif change == "preempted":
        seqs[1].num_cached_tokens = 0
        seqs[1].num_scheduled_tokens = seqs[1].num_tokens
    assert carry.take(seqs) is None
