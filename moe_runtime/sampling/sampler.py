"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, optional logprobs,
after the logits processors (structured output, min_tokens, logit_bias, penalties: `process`).

Random draws are made on the logits' device for all sampled rows at once, keyed by each request's seed
and the position it samples (`counter_noise.exponential_race`): no probabilities go to the host, and a
seeded request draws the same tokens in any batch, on any device, after a preemption or a P/D hand-off.

One request's bad luck stays its own: a row whose probabilities are not finite, whose grammar could
not be set up, or whose draw raises, gets an error instead of a token and the other rows are sampled
as usual. Everything before the per-row draws is vectorised and consumes no random numbers (nor
changes any request's state: grammar matchers advance in the engine core, after sampling), so if it
raises the caller can sample each request on its own (`EngineCore`) and seeded requests still draw
exactly what they would have drawn in any other batch.

Logprobs are the model's own (log-softmax of the raw logits, before any processor) by default, as vLLM
reports them; the engine's `logprobs_mode` may ask for those of the distribution each token was drawn from
instead, or for logits (moe_runtime/config/logprobs_mode.py).

Nothing here reads the device before the end: `draw` leaves the tokens, each row's verdict (`DrawStatus`)
and the asked logprobs on the device, and `DeviceDraw.to_host` brings them back in one copy, the step's
result (moe_runtime/sampling/device_draw.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from moe_runtime.sampling.host_reads import step_result_transfer
from moe_runtime.sampling.counter_noise import exponential_race
from moe_runtime.sampling.device_draw import DeviceDraw, DrawStatus, SampleResult, TopLogprobs
from moe_runtime.config.logprobs_mode import LogprobsMode
from moe_runtime.sampling.logits_processors import (add_logit_bias, apply_min_p, apply_penalties,
                                           ban_stop_tokens_below_min_tokens)
from moe_runtime.sampling.sampling_row import SamplingRow
from moe_runtime.sampling.structured_output.grammar_bitmask import GrammarBitmask


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k (0 = off) and nucleus top-p (1 = off) with -inf."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)     # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]           # [1, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                            # probability mass of better tokens
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False                                                    # the best token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


@dataclass
class ProcessedLogits:
    logits: torch.Tensor               # [B, V] float32, what every choice is made from
    errors: list[str | None]           # [B], why a row cannot be sampled; None = it can


@dataclass
class DeviceProcessedLogits:
    logits: torch.Tensor               # [B, V] float32, what every choice is made from
    errors: list[str | None]           # [B], failures known on the host (a grammar that could not be set up)
    status: torch.Tensor               # [B] int64 DrawStatus codes, on the logits' device


@dataclass
class SampledRows:
    """The rows of a batch drawn at random (not greedy, not failed on the host), on the logits' device."""

    index: torch.Tensor              # [S] int64 rows of the batch
    logits: torch.Tensor             # [S, V] float32 after temperature, min-p, top-k, top-p (dropped: -inf)
    probs: torch.Tensor              # [S, V] float32 their softmax (non-finite: 0)
    usable: torch.Tensor             # [S] bool: the probabilities were finite and had mass
    seeds: torch.Tensor              # [S] int64 what keys each row's draws
    positions: torch.Tensor          # [S] int64 the position each row samples

    @classmethod
    def of(cls, processed: DeviceProcessedLogits, seqs: list[SamplingRow]) -> "SampledRows | None":
        rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy and processed.errors[i] is None]
        if not rows:
            return None
        logits = Sampler.sampling_logits(processed.logits, seqs, rows)                     # [S, V]
        probs = logits.softmax(dim=-1)                                                     # [S, V]
        device = probs.device
        usable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)               # [S]
        return cls(torch.tensor(rows, dtype=torch.int64, device=device), logits, probs.nan_to_num(0.0), usable,
                   torch.tensor([seqs[row].sampling_seed for row in rows], dtype=torch.int64, device=device),
                   torch.tensor([seqs[row].num_tokens for row in rows], dtype=torch.int64, device=device))

    def flag_unusable(self, status: torch.Tensor) -> torch.Tensor:
        """The batch's status [B] with these rows' unusable probabilities marked (a failure known before wins)."""
        before = status[self.index]                                                         # [S]
        verdict = torch.where((before == DrawStatus.OK) & ~self.usable, DrawStatus.PROBS_NOT_FINITE, before)
        return status.index_copy(0, self.index, verdict)


class Sampler:
    """`eos_token_ids`: the engine's EOS ids, which min_tokens holds back; `grammar_threads`: xgrammar's
    threads for filling the bitmasks of large batches (`GrammarBitmask`); `logprobs_mode`: what the asked
    logprobs are (`LogprobsMode`)."""

    def __init__(self, eos_token_ids: Iterable[int] = (), grammar_threads: int = 1,
                 logprobs_mode: LogprobsMode | str = LogprobsMode.RAW_LOGPROBS):
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))   # what min_tokens holds back (unless ignore_eos)
        self.grammar_bitmask = GrammarBitmask(grammar_threads)
        self.logprobs_mode = LogprobsMode.parse(logprobs_mode)

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SampleResult:  # logits [B, V]
        drawn = self.draw(logits, seqs)
        with step_result_transfer():
            return drawn.to_host()

    def draw(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> DeviceDraw:  # logits [B, V]
        """The batch's tokens, row failures and asked logprobs, left on the logits' device (no host read)."""
        raw = logits.float()
        processed = self.process_on_device(raw, seqs)
        token_ids = processed.logits.argmax(dim=-1)                                        # [B] the greedy choice
        status = processed.status                                                          # [B]
        sampled = SampledRows.of(processed, seqs)
        if sampled is not None:   # nothing above draws a random number: from here on, a failure is one row's alone
            token_ids = token_ids.index_copy(0, sampled.index,
                                             exponential_race(sampled.probs, sampled.seeds, sampled.positions))
            status = sampled.flag_unusable(status)
        return DeviceDraw(token_ids, status, processed.errors,
                          self.asked_logprobs(raw, processed, sampled, token_ids, seqs))

    def asked_logprobs(self, raw: torch.Tensor, processed: DeviceProcessedLogits, sampled: SampledRows | None,
                       token_ids: torch.Tensor, seqs: list[SamplingRow]) -> TopLogprobs | None:
        """The logprobs the rows that asked for them want, as `logprobs_mode` says: from the raw logits [B, V],
        or from what each row's token was chosen from (`processed`, and `sampled`'s rows after temperature,
        min-p, top-k and top-p); the rows' tokens [B]."""
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not wanted:
            return None
        scores = raw                                                                       # [B, V]
        if self.logprobs_mode.processed:
            scores = processed.logits
            if sampled is not None:
                scores = scores.index_copy(0, sampled.index, sampled.logits)
        return TopLogprobs.of(scores, token_ids, wanted, [seqs[row].params.logprobs for row in wanted],
                              normalize=self.logprobs_mode.normalized)

    def process(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> ProcessedLogits:
        """The batch's logits [B, V] after structured output, min_tokens, logit_bias and the penalties, in
        that order (vLLM's): each a batched op, skipped when no row uses it. `logits` is not changed."""
        on_device = self.process_on_device(logits, seqs)
        errors = [error if error is not None else DrawStatus.message(code)
                  for error, code in zip(on_device.errors, on_device.status.tolist())]
        return ProcessedLogits(on_device.logits, errors)

    def process_on_device(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> DeviceProcessedLogits:
        """`process` without reading the rows' verdicts back: they stay on the device as `DrawStatus` codes."""
        errors: list[str | None] = [None] * len(seqs)
        constrained = []
        for row, seq in enumerate(seqs):
            if seq.grammar is not None:
                if seq.grammar.error is not None:
                    errors[row] = seq.grammar.error
                else:
                    constrained.append(row)
        if constrained:
            logits = logits.clone()  # the mask is applied in place
            self.grammar_bitmask.apply(logits, constrained, [seqs[row].grammar for row in constrained])
        logits = ban_stop_tokens_below_min_tokens(logits, seqs, self.eos_token_ids)
        logits = add_logit_bias(logits, seqs)
        logits = apply_penalties(logits, seqs)
        has_token = torch.isfinite(logits).any(dim=-1)                                     # [B]
        has_nan = torch.isnan(logits).any(dim=-1)                                          # [B]
        no_token = torch.where(has_nan, DrawStatus.LOGITS_NOT_FINITE, DrawStatus.NO_TOKEN_ALLOWED)
        status = torch.where(has_token, DrawStatus.OK, no_token).to(torch.int64)          # [B]
        return DeviceProcessedLogits(logits, errors, status)

    @staticmethod
    def sampling_probs(logits: torch.Tensor, seqs: list[SamplingRow], rows: list[int]) -> torch.Tensor:
        """Probabilities [S, V] of the sampled rows after temperature, min-p, top-k and top-p."""
        return Sampler.sampling_logits(logits, seqs, rows).softmax(dim=-1)

    @staticmethod
    def sampling_logits(logits: torch.Tensor, seqs: list[SamplingRow], rows: list[int]) -> torch.Tensor:
        """Logits [S, V] of the sampled rows after temperature, min-p, top-k and top-p (dropped tokens: -inf)."""
        vocab = logits.shape[-1]
        device = logits.device
        params = [seqs[i].params for i in rows]
        temperature = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32, device=device)  # [S]
        top_k = torch.tensor([min(max(p.top_k, 0), vocab) for p in params], dtype=torch.int64, device=device)  # [S]
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device)  # [S]
        min_p = torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device)  # [S]
        index = torch.tensor(rows, device=device)
        scaled = logits[index] / temperature[:, None]                                        # [S, V]
        if any(p.min_p > 0 for p in params):                                                 # decided on the host
            scaled = apply_min_p(scaled, min_p)
        return apply_top_k_top_p(scaled, top_k, top_p)
