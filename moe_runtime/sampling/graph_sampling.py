"""Sampling inside the captured decode step: the graph returns one token id (and a `DrawStatus`) per row.

The eager `Sampler` builds its per-row parameters on the host and runs its ops one by one after the logits
come out of the captured step; here the same ops are traced into the step itself, so a pure decode step is
one call from the input ids to the token ids and the host reads [2, B] int64 once (tokens and statuses).

The rows' parameters go in as [B] tensors with neutral values where a row does not use them (temperature 1
and `greedy` set for greedy rows, top_k 0, top_p 1, min_p 0, penalties 1 / 0 / 0), so one graph serves any
mix of greedy and sampled rows. Each op is the eager sampler's own (`apply_top_k_top_p`, `apply_min_p`'s
threshold, `exponential_race` keyed by the row's seed and the position it samples): a seeded request draws
the same token in the graph as in the eager sampler from the same logits, and greedy rows take the argmax
of the same processed logits. The position a decode row samples is its input position + 1 (its
`num_tokens`), computed in the graph.

Three graph kinds (`GraphSamplingKind`), because the ops a batch needs differ a lot in cost and a compiled
graph runs all it holds: GREEDY (an argmax; every batch that samples nothing at random, and the kind whose
logits a fallback batch samples eagerly), SAMPLED (temperature, min-p, top-k, top-p, the seeded draw:
a sort of every row's vocabulary) and PENALIZED (SAMPLED after repetition / frequency / presence penalties,
from count tensors [B, V] built on the host as the eager sampler builds them; a carried step adds its rows'
drawn tokens to the kept counts instead, `GraphSampling.after_drawing`).

What stays with the eager sampler, for the whole batch (`GraphSampling.refusal` names why): structured
output (the grammar's bitmask is filled on the host, per step), logit_bias, an active min_tokens ban,
logprobs (their top-N lists), and any row that verifies drafts. Such a batch still runs the captured
forward; the eager sampler then samples its logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence as Seq

import torch

from moe_runtime.sampling.counter_noise import exponential_race
from moe_runtime.sampling.device_draw import DeviceDraw, DrawStatus
from moe_runtime.sampling.logits_processors import min_p_masked, penalize, penalty_counts
from moe_runtime.sampling.sampler import apply_top_k_top_p

PENALIZED_OUTPUT_COUNTS = 9   # where the penalized kind's [rows, V] output counts are in `GraphSampling.tensors`
from moe_runtime.sampling.sampling_row import SamplingRow


class GraphSamplingKind(Enum):
    GREEDY = "greedy"          # argmax only
    SAMPLED = "sampled"        # + temperature, min-p, top-k, top-p, seeded draws
    PENALIZED = "penalized"    # + repetition, frequency and presence penalties first

    @property
    def inputs(self) -> int:
        """Tensors the kind's graph takes after the forward's five."""
        return {GraphSamplingKind.GREEDY: 0, GraphSamplingKind.SAMPLED: 6, GraphSamplingKind.PENALIZED: 11}[self]


@dataclass
class GraphSampling:
    """One batch's sampling parameters as the graph takes them, padded to the bucket's rows."""

    kind: GraphSamplingKind
    tensors: tuple[torch.Tensor, ...]   # `kind.inputs` of them, in `sample_in_graph`'s order

    @staticmethod
    def refusal(seqs: Seq[SamplingRow]) -> str | None:
        """Why this batch must be sampled by the eager sampler (None: the graph samples it). Decided per batch,
        on the host, from the rows' parameters alone."""
        for seq in seqs:
            params = seq.params
            if getattr(seq, "drafts", None) is not None and seq.drafts.token_ids:
                return "a row verifies drafts"
            if seq.grammar is not None:
                return "structured output"
            if params.logit_bias:
                return "logit_bias"
            if len(seq.output_token_ids) < params.min_tokens:
                return "min_tokens"
            if params.logprobs is not None:
                return "logprobs"
        return None

    @classmethod
    def kind_of(cls, seqs: Seq[SamplingRow]) -> GraphSamplingKind:
        params = [seq.params for seq in seqs]
        if any(p.penalized for p in params):
            return GraphSamplingKind.PENALIZED
        if any(not p.greedy for p in params):
            return GraphSamplingKind.SAMPLED
        return GraphSamplingKind.GREEDY

    @classmethod
    def of(cls, seqs: Seq[SamplingRow], rows: int, vocab: int, device: torch.device) -> "GraphSampling":
        """`seqs`' parameters for a graph of `rows` rows (pad rows: greedy, neutral)."""
        kind = cls.kind_of(seqs)
        if kind is GraphSamplingKind.GREEDY:
            return cls(kind, ())
        pad = rows - len(seqs)
        params = [seq.params for seq in seqs]

        def column(values: list, neutral, dtype: torch.dtype) -> torch.Tensor:   # [rows]
            return torch.tensor(values + [neutral] * pad, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        tensors = (column(greedy, True, torch.bool),
                   column([1.0 if g else float(p.temperature) for g, p in zip(greedy, params)], 1.0, torch.float32),
                   column([min(max(p.top_k, 0), vocab) for p in params], 0, torch.int64),
                   column([float(p.top_p) for p in params], 1.0, torch.float32),
                   column([float(p.min_p) for p in params], 0.0, torch.float32),
                   column([seq.sampling_seed for seq in seqs], 0, torch.int64))
        if kind is GraphSamplingKind.PENALIZED:
            output_counts, prompt_counts = penalty_counts(seqs, vocab, device)                 # [B, V] each
            tensors += (column([float(p.repetition_penalty) for p in params], 1.0, torch.float32),
                        column([float(p.frequency_penalty) for p in params], 0.0, torch.float32),
                        column([float(p.presence_penalty) for p in params], 0.0, torch.float32),
                        torch.nn.functional.pad(output_counts, (0, 0, 0, pad)),                # [rows, V]
                        torch.nn.functional.pad(prompt_counts, (0, 0, 0, pad)))                # [rows, V]
        return cls(kind, tensors)

    def after_drawing(self, tokens: list[int], counted: list[bool]) -> None:
        """Make these the same rows' parameters for their next step, each having drawn `tokens[i]`
        (execution/decode_carry.py): the penalized kind's output counts one more, in place, at the token of every
        `counted` row (a row with a penalty): what `penalty_counts` gives over the outputs one token longer. The
        other kinds' parameters do not change with the tokens."""
        rows = [row for row, count in enumerate(counted) if count]
        if self.kind is GraphSamplingKind.PENALIZED and rows:
            output_counts = self.tensors[PENALIZED_OUTPUT_COUNTS]                                  # [rows, V]
            output_counts[rows, [tokens[row] for row in rows]] += 1.0

    @staticmethod
    def draw(tokens_status: torch.Tensor, rows: int) -> DeviceDraw:
        """The graph's [2, bucket] output as the eager sampler's `DeviceDraw` of the batch's first `rows` rows."""
        return DeviceDraw(tokens_status[0, :rows], tokens_status[1, :rows], [None] * rows, None)


def sample_in_graph(logits: torch.Tensor, positions: torch.Tensor, *sampling: torch.Tensor) -> torch.Tensor:
    """Traced inside the step: logits [B, V] fp32 and the rows' input positions [B] -> [2, B] int64, each row's
    token and `DrawStatus`. `sampling` is empty (GREEDY), or greedy [B] bool, temperature, top_k, top_p, min_p,
    seeds [B] (SAMPLED), and after them repetition, frequency, presence [B] and the output / prompt token
    counts [B, V] (PENALIZED)."""
    if len(sampling) == GraphSamplingKind.PENALIZED.inputs:
        logits = _penalized(logits, *sampling[6:])
    has_token = torch.isfinite(logits).any(dim=-1)                                          # [B]
    no_token = torch.where(torch.isnan(logits).any(dim=-1), DrawStatus.LOGITS_NOT_FINITE, DrawStatus.NO_TOKEN_ALLOWED)
    status = torch.where(has_token, DrawStatus.OK, no_token).to(torch.int64)               # [B]
    tokens = logits.argmax(dim=-1)                                                           # [B]
    if sampling:
        greedy, temperature, top_k, top_p, min_p, seeds = sampling[:6]
        scaled = logits / temperature[:, None]                                               # [B, V]
        scaled = min_p_masked(scaled, min_p)
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)                      # [B, V]
        usable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)                # [B]
        drawn = exponential_race(probs.nan_to_num(0.0), seeds, positions + 1)                # [B]
        tokens = torch.where(greedy, tokens, drawn)
        unusable = ~greedy & (status == DrawStatus.OK) & ~usable
        status = torch.where(unusable, DrawStatus.PROBS_NOT_FINITE, status)
    return torch.stack([tokens, status])                                                     # [2, B]


def _penalized(logits: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
               output_counts: torch.Tensor, prompt_counts: torch.Tensor) -> torch.Tensor:
    """`penalize`, the eager sampler's arithmetic; the counts are [B, vocab], and an LM head with more rows than
    the vocabulary (padded) gets zero counts for the extra ones."""
    extra = logits.shape[-1] - output_counts.shape[-1]    # known when traced: the graph's shapes are static
    if extra > 0:
        output_counts = torch.nn.functional.pad(output_counts, (0, extra))
        prompt_counts = torch.nn.functional.pad(prompt_counts, (0, extra))
    return penalize(logits, repetition, frequency, presence, output_counts, prompt_counts)
