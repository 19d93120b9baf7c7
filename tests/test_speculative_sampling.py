"""Speculative sampling for temperature > 0: the tokens a verified step emits follow the target's distribution.

- the verifier's device math (`rejection_sampling`) fed fixed target distributions over a small vocabulary, one
  sequence per seed (and one seed over many positions): the first, second and third emitted tokens each pass a
  chi-square test against the target's row for them, with point-mass drafts (prompt lookup) and drafts drawn
  from a distribution q (accepted at the rate sum min(p, q)); the same statistic rejects deliberately wrong
  rules (always accepting, drawing a rejected row from p instead of the residual, accepting by p / q but
  drawing the residual of a point mass);
- through `VerifyingSampler` with `Sequence`s: the target is the distribution after the request's temperature,
  top-k and top-p (a cut token is never emitted), a seeded sequence draws the same tokens alone and in a batch;
- the engine: seeded sampled requests draft and accept drafts, give the same tokens run to run and alone or
  together, and with top_k=1 (the target a point mass) the tokens greedy decoding gives.
"""
from __future__ import annotations

import pytest
import torch

from tiny_checkpoints import hf_greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.counter_noise import exponential_race
from moe_runtime.sampling.sampler import Sampler
from moe_runtime.speculative.rejection_sampling import (Emission, RowLayout, RowVerdicts, emit,
                                                        sampled_verdicts)
from moe_runtime.speculative.verification import VerifyingSampler

pytestmark = pytest.mark.timeout(600)

# 99.9% points of the chi-square distribution by degrees of freedom: a correct sampler fails one fixed-seed
# case in a thousand; the wrong rules below land tens to thousands of times above them
CHI_SQUARE_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
TARGET = torch.tensor([[0.30, 0.05, 0.20, 0.10, 0.15, 0.00, 0.12, 0.08],     # row 0: verifies draft 0
                       [0.10, 0.25, 0.05, 0.20, 0.00, 0.30, 0.04, 0.06],     # row 1: verifies draft 1
                       [0.02, 0.08, 0.40, 0.00, 0.25, 0.05, 0.10, 0.10]])    # row 2: the bonus row
DRAFTS = [2, 5]                                      # p = 0.20 at row 0, 0.30 at row 1
SEQUENCES = 40_000


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `tokens` [N] against `probs` [V], and its degrees of freedom; a token of
    probability 0 drawn counts as infinite."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return float("inf"), int(support.sum()) - 1
    expected = probs[support].double() * tokens.numel()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    statistic, dof = chi_square(tokens, probs)
    assert tokens.numel() > 1000, f"{what}: too few samples ({tokens.numel()}) to judge"
    assert statistic < CHI_SQUARE_999[dof], f"{what}: chi-square {statistic:.1f} over {dof} degrees of freedom"


def assert_detected(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    statistic, dof = chi_square(tokens, probs)
    assert statistic > 10 * CHI_SQUARE_999[dof], f"{what} went unnoticed: chi-square {statistic:.1f}"


def batch_rows(seeds: torch.Tensor, positions: torch.Tensor):
    """SEQUENCES sequences with DRAFTS each, flattened to rows as the verifier sees them."""
    layout = RowLayout.of([DRAFTS] * len(seeds))
    rows = len(DRAFTS) + 1
    target = TARGET.repeat(len(seeds), 1)                                                 # [R, V]
    draft_ids = torch.tensor(layout.draft_ids)                                            # [R]
    row_seeds = seeds.repeat_interleave(rows)                                             # [R]
    row_positions = (positions[:, None] + torch.arange(rows)).flatten()                   # [R] each row its position
    return layout, target, draft_ids, row_seeds, row_positions


def emitted_tokens(verdicts: RowVerdicts, layout: RowLayout,
                   draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's tokens in emission order [N, 1 + d] (valid up to its emitted row) and its accepted drafts [N]."""
    emission: Emission = emit(verdicts, verdicts.accepted, draft_ids, torch.tensor(layout.row_seq),
                              torch.tensor(layout.seq_starts))
    rows = len(DRAFTS) + 1
    emitted = emission.emitted.view(-1, rows)
    assert bool((emitted.sum(dim=1) == 1).all()), "every sequence ends its step on exactly one row"
    return emission.tokens.view(-1, rows), emitted.to(torch.int64).argmax(dim=1)


def check_every_emitted_position(tokens: torch.Tensor, accepted: torch.Tensor, what: str) -> None:
    """Token j of a sequence exists when drafts 0..j-1 were accepted; it follows row j of the target."""
    for j in range(len(DRAFTS) + 1):
        reached = accepted >= j
        assert_follows(tokens[reached, j], TARGET[j], f"{what}, emitted token {j}")


@pytest.mark.parametrize("keyed_by", ["seed", "position"])
def test_point_mass_drafts_emit_tokens_distributed_as_the_target(keyed_by):
    """Prompt-lookup drafts: accepted with the target's probability of them, the residual without them."""
    if keyed_by == "seed":                      # one sequence per seed, all at the same position
        seeds, positions = torch.arange(SEQUENCES) * 7919 + 3, torch.full((SEQUENCES,), 17)
    else:                                       # one seed, sequences at positions far apart (no shared rows)
        seeds, positions = torch.full((SEQUENCES,), 12345), torch.arange(SEQUENCES) * 3
    layout, target, draft_ids, row_seeds, row_positions = batch_rows(seeds, positions)
    verdicts = sampled_verdicts(target, draft_ids, row_seeds, row_positions)
    tokens, accepted = emitted_tokens(verdicts, layout, draft_ids)
    check_every_emitted_position(tokens, accepted, f"keyed by {keyed_by}")
    acceptance = float((accepted >= 1).double().mean())
    assert abs(acceptance - float(TARGET[0, DRAFTS[0]])) < 0.01, f"draft 0 accepted at {acceptance:.3f}"


def test_wrong_acceptance_rules_are_detected_by_the_same_statistic():
    """What the test above would see from an implementation that always accepts, or that draws a rejected
    row's token from p (the draft kept in) instead of the residual."""
    seeds, positions = torch.arange(SEQUENCES) * 7919 + 3, torch.full((SEQUENCES,), 17)
    layout, target, draft_ids, row_seeds, row_positions = batch_rows(seeds, positions)
    right = sampled_verdicts(target, draft_ids, row_seeds, row_positions)
    always = RowVerdicts(draft_ids >= 0, right.next_token)
    tokens, _ = emitted_tokens(always, layout, draft_ids)
    assert_detected(tokens[:, 0], TARGET[0], "always accepting")
    from_p = RowVerdicts(right.accepted, exponential_race(target, row_seeds, row_positions))
    tokens, _ = emitted_tokens(from_p, layout, draft_ids)
    statistic, dof = chi_square(tokens[:, 0], TARGET[0])
    assert statistic > 4 * CHI_SQUARE_999[dof], f"a residual drawn from p went unnoticed: chi-square {statistic:.1f}"


def test_drafts_drawn_from_a_distribution_are_accepted_by_the_ratio_and_the_residual_corrects():
    """A drafter with its own distribution q (each row's draft drawn from it): min(1, p/q) and max(0, p - q)."""
    draft_q = torch.tensor([0.05, 0.05, 0.50, 0.05, 0.05, 0.20, 0.05, 0.05])              # a drafter that likes 2, 5
    seeds = torch.arange(SEQUENCES) * 104729 + 1
    rows = len(DRAFTS) + 1
    drafts = exponential_race(draft_q.expand(SEQUENCES * len(DRAFTS), -1),                # [N * d] the drafter's draws
                              seeds.repeat_interleave(len(DRAFTS)) + 10**9, torch.arange(SEQUENCES * len(DRAFTS)))
    drafts = drafts.view(SEQUENCES, len(DRAFTS))
    layout = RowLayout.of(drafts.tolist())
    draft_ids = torch.tensor(layout.draft_ids)
    target = TARGET.repeat(SEQUENCES, 1)
    q = draft_q.expand(SEQUENCES * rows, -1).clone()                                      # bonus rows: unused
    row_seeds = seeds.repeat_interleave(rows)
    row_positions = torch.arange(rows).repeat(SEQUENCES) + 40
    verdicts = sampled_verdicts(target, draft_ids, row_seeds, row_positions, q)
    tokens, accepted = emitted_tokens(verdicts, layout, draft_ids)
    check_every_emitted_position(tokens, accepted, "drafts drawn from q")
    acceptance = float((accepted >= 1).double().mean())
    overlap = float(torch.minimum(TARGET[0], draft_q).sum())                             # sum_x min(p, q): 0.5
    assert abs(acceptance - overlap) < 0.01, f"draft 0 accepted at {acceptance:.3f}, not {overlap}"
    as_point_masses = sampled_verdicts(target, draft_ids, row_seeds, row_positions)      # the residual p without x
    ratio_with_wrong_residual = RowVerdicts(verdicts.accepted, as_point_masses.next_token)
    tokens, _ = emitted_tokens(ratio_with_wrong_residual, layout, draft_ids)
    assert_detected(tokens[:, 0], TARGET[0], "accepting by p / q but drawing the residual of a point mass")


# ---- through VerifyingSampler, with the request's logits processors ---------------------------------------
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.3, -0.5, 0.8, 0.1])


def sampled_sequence(index: int, drafts: list[int], seed: int, **params) -> Sequence:
    seq = Sequence(f"s{index}", [1, 2, 3], SamplingParams(max_tokens=8, seed=seed, **params), arrival=index)
    seq.drafts.token_ids = list(drafts)
    return seq


def test_the_target_is_the_distribution_after_temperature_top_k_and_top_p():
    params = {"temperature": 0.7, "top_k": 5, "top_p": 0.9}
    sampler = VerifyingSampler(Sampler(), None)
    seqs = [sampled_sequence(i, [3, 5], seed=i, **params) for i in range(12_000)]   # 5 is cut by top-k
    logits = LOGITS.expand(3 * len(seqs), -1).clone()                                     # [R, V] each row alike
    result = sampler(logits, seqs)
    expected = Sampler.sampling_probs(LOGITS[None], seqs[:1], [0])[0]          # what plain sampling draws from
    assert int((expected > 0).sum()) < 5, "top-p was meant to cut into the top 5"
    first = torch.tensor([accepted[0][0] if accepted else token
                          for token, accepted in zip(result.token_ids, result.accepted_rows())])
    assert_follows(first, expected, "the first emitted token")
    assert all(error is None for error in result.errors)
    assert all(len(accepted) < 2 for accepted in result.accepted_rows()), "a draft of probability 0 was accepted"
    assert any(result.accepted_rows()), "draft 3 (probability ~0.14) was never accepted"


def test_a_seeded_sequence_verifies_to_the_same_tokens_alone_and_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(9, 50)                                                           # [R, V] 3 rows x 3 sequences
    sampler = VerifyingSampler(Sampler(), None)

    def batch():
        return [sampled_sequence(i, [7, 9], seed=100 + i, temperature=0.9) for i in range(3)]

    together = sampler(logits, batch())
    alone = [sampler(logits[3 * i : 3 * i + 3], [batch()[i]]) for i in range(3)]
    reversed_rows = torch.cat([logits[6:9], logits[3:6], logits[0:3]])
    backwards = sampler(reversed_rows, batch()[::-1])
    assert together.token_ids == [a.token_ids[0] for a in alone] == backwards.token_ids[::-1]
    assert together.accepted_rows() == [a.accepted_rows()[0] for a in alone] == backwards.accepted_rows()[::-1]


# ---- the engine ------------------------------------------------------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
BASE = [5, 17, 42, 99, 3, 8, 61, 200, 31, 7]
PROMPTS = [BASE * 4, [7, 8, 9] * 6 + [1, 2], BASE[::-1] * 3 + [64]]


def accepted_and_drafted(llm: LLM) -> tuple[int, int]:
    workers = llm.engine.stats().workers
    return sum(w.spec_accepted_tokens for w in workers), sum(w.spec_draft_tokens for w in workers)


def test_seeded_speculative_sampling_is_reproducible_and_a_point_mass_target_gives_greedy_tokens(
        tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    # a cold distribution: the model's favourites dominate, so prompt-lookup drafts are sometimes accepted
    params = [SamplingParams(max_tokens=24, temperature=0.3, seed=11 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    point_mass = SamplingParams(max_tokens=24, temperature=0.8, top_k=1, seed=5, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", speculative_config=NGRAM) as llm:
        first = [o.token_ids for o in llm.generate(PROMPTS, params)]
        accepted, drafted = accepted_and_drafted(llm)
        second = [o.token_ids for o in llm.generate(PROMPTS, params)]
        alone = [llm.generate([prompt], [p])[0].token_ids for prompt, p in zip(PROMPTS, params)]
        top_one = [o.token_ids for o in llm.generate(PROMPTS, point_mass)]
    assert drafted > 0 and accepted > 0, "sampled requests were meant to draft and have drafts accepted"
    assert first == second == alone
    assert top_one == hf_greedy(path, PROMPTS, 24)
