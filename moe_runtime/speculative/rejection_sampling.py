"""Speculative sampling: drafts verified against the target's distribution, so that the tokens a step emits
follow the target exactly whatever the drafts were (Leviathan et al. 2023, Chen et al. 2023).

Row j of a drafting sequence holds the target's distribution p for the position of its draft x_j, after the
request's logits processors, temperature, min-p, top-k and top-p: what the plain sampler would draw from there.
The draft was drawn from q (a point mass for prompt lookup and for argmax drafters: q(x) = 1, q elsewhere 0):

- x_j is accepted with probability min(1, p(x_j) / q(x_j)): a uniform u keyed by the request's seed and the
  row's position (`counter_noise.stream_uniform`, a stream of its own) decides, `u * q(x) < p(x)`;
- the first row whose draft is not accepted emits a token drawn from the residual max(0, p - q), normalised
  (for a point mass: p without x); when every draft is accepted, the row after them (the bonus row, no draft)
  emits a token drawn from p;
- those draws are the exponential race keyed by (seed, position), the noise the plain sampler uses at that
  position: a bonus row draws what plain decoding would draw there.

So the same seed gives the same tokens in any batch, on any device, after a preemption (the same rows meet the
same drafts: drafts depend only on the sequence). A greedy row is the limit p = one-hot(argmax): its draft is
accepted when it is the argmax, and the argmax is emitted otherwise, with no random number at all.

Everything is tensor work on the logits' device over every row of the batch at once (`RowVerdicts` per row,
`Emission` per sequence): the host learns the outcome with the step's one result copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.sampling.counter_noise import exponential_race, stream_uniform

ACCEPTANCE_STREAM = 0x5EC0ACC7      # names the acceptance uniforms' stream beside the token noise


@dataclass
class RowVerdicts:
    accepted: torch.Tensor      # [R] bool: the row's draft is accepted (False on a bonus row, which has none)
    next_token: torch.Tensor    # [R] int64: what the row emits if it is its sequence's first unaccepted row

    def overwritten(self, rows: torch.Tensor, part: "RowVerdicts") -> "RowVerdicts":
        """These verdicts with `rows` [S] taken from `part` (verdicts of those rows only)."""
        return RowVerdicts(self.accepted.index_copy(0, rows, part.accepted),
                           self.next_token.index_copy(0, rows, part.next_token))


def greedy_verdicts(logits: torch.Tensor, draft_ids: torch.Tensor) -> RowVerdicts:
    """Rows decoded greedily: logits [R, V] after the processors, draft_ids [R] (-1: a bonus row)."""
    best = logits.argmax(dim=-1)                                                     # [R]
    return RowVerdicts((draft_ids >= 0) & (draft_ids == best), best)


def sampled_verdicts(target: torch.Tensor, draft_ids: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> RowVerdicts:
    """Rows decoded by sampling: target [S, V] probabilities (finite, rows summing to 1), draft_ids [S]
    (-1: a bonus row), each row's seed [S] and position [S], the drafter's probabilities [S, V] (None: each
    draft a point mass)."""
    has_draft = draft_ids >= 0                                                       # [S]
    drafts = draft_ids.clamp(min=0)[:, None]                                         # [S, 1]
    p_of_draft = target.gather(1, drafts).squeeze(1)                                 # [S]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
        residual = target.scatter(1, drafts, 0.0)                                    # [S, V] p without the draft
    else:
        q_of_draft = draft_probs.gather(1, drafts).squeeze(1)
        residual = (target - draft_probs).clamp(min=0.0)
    residual = torch.where(has_draft[:, None], residual, target)                    # a bonus row draws from p
    # no residual mass only where p <= q everywhere (p == q): that row's draft is accepted surely, and its
    # draw is never emitted; p keeps the race well defined there
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target)
    u = stream_uniform(seeds, positions, ACCEPTANCE_STREAM)                          # [S]
    accepted = has_draft & (u * q_of_draft < p_of_draft)
    return RowVerdicts(accepted, exponential_race(residual, seeds, positions))


@dataclass
class RowLayout:
    """Where each sequence's rows lie in the batch's R logits rows (host lists, sent once per step)."""

    draft_ids: list[int]        # [R] the draft each row verifies; -1 on a sequence's last (bonus) row
    row_seq: list[int]          # [R] the sequence each row belongs to
    seq_starts: list[int]       # [B] each sequence's first row

    @classmethod
    def of(cls, drafts: list[list[int]]) -> "RowLayout":
        """Sequences with `drafts` each (possibly none): 1 + len(drafts) rows per sequence."""
        draft_ids, row_seq, seq_starts = [], [], []
        for index, own in enumerate(drafts):
            seq_starts.append(len(draft_ids))
            draft_ids += [*own, -1]
            row_seq += [index] * (len(own) + 1)
        return cls(draft_ids, row_seq, seq_starts)


@dataclass
class Emission:
    tokens: torch.Tensor        # [R] int64: the accepted drafts, then each sequence's emitted token, then filler
    emitted: torch.Tensor       # [R] bool: the row whose token ends its sequence's step (one per sequence)


def emit(verdicts: RowVerdicts, accepted: torch.Tensor, draft_ids: torch.Tensor, row_seq: torch.Tensor,
         seq_starts: torch.Tensor) -> Emission:
    """Each sequence's leading accepted rows, then its first unaccepted one: accepted [R] bool (the verdicts'
    acceptance, less rows that failed), draft_ids [R], row_seq [R] and seq_starts [B] as in `RowLayout`."""
    rejected = (~accepted).to(torch.int64)                                           # [R]
    running = rejected.cumsum(dim=0)                                                 # [R]
    before_seq = (running - rejected)[seq_starts]                                    # [B] rejections before its rows
    within = running - before_seq[row_seq]                                           # [R] ... and within them
    tokens = torch.where(within == 0, draft_ids, verdicts.next_token)
    return Emission(tokens, (within == 1) & ~accepted)
