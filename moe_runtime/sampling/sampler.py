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

Logprobs are the model's own (log-softmax of the raw logits, before any processor), as vLLM reports
them by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterable

import torch

from moe_runtime.sampling.counter_noise import exponential_race
from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.sampling.logits_processors import (add_logit_bias, apply_min_p, apply_penalties,
                                           ban_stop_tokens_below_min_tokens)
from moe_runtime.engine.outputs import error_message
from moe_runtime.engine.sequence import Sequence
from moe_runtime.sampling.structured_output.grammar_bitmask import GrammarBitmask

@dataclass
class SampleResult:
    token_ids: list[int]                       # [B], NO_TOKEN where the row failed
    logprobs: list[TokenLogprob | None]        # [B], None where the request did not ask (or failed)
    errors: list[str | None]                   # [B], why the row could not be sampled; None = sampled

    NO_TOKEN: ClassVar[int] = -1

    @classmethod
    def empty(cls) -> "SampleResult":
        return cls([], [], [])

    @classmethod
    def failed(cls, message: str) -> "SampleResult":
        """One row that could not be sampled."""
        return cls([cls.NO_TOKEN], [None], [message])

    @classmethod
    def concat(cls, parts: list["SampleResult"]) -> "SampleResult":
        return cls([t for p in parts for t in p.token_ids], [lp for p in parts for lp in p.logprobs],
                   [e for p in parts for e in p.errors])


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


class Sampler:
    """`eos_token_ids`: the engine's EOS ids, which min_tokens holds back; `grammar_threads`: xgrammar's
    threads for filling the bitmasks of large batches (`GrammarBitmask`)."""

    def __init__(self, eos_token_ids: Iterable[int] = (), grammar_threads: int = 1):
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))   # what min_tokens holds back (unless ignore_eos)
        self.grammar_bitmask = GrammarBitmask(grammar_threads)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:  # logits [B, V]
        raw = logits.float()
        processed = self.process(raw, seqs)
        errors = processed.errors
        token_ids = processed.logits.argmax(dim=-1).tolist()             # [B] the greedy choice
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy and errors[i] is None]
        probs = self._probs(processed.logits, seqs, sampled_rows) if sampled_rows else None   # [S, V]
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        logp = raw[wanted].log_softmax(dim=-1) if wanted else None                        # [W, V]
        # nothing above draws a random number: from here on, a failure is one row's alone
        if probs is not None:
            usable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)                 # [S]
            device = probs.device
            seeds = torch.tensor([seqs[row].sampling_seed for row in sampled_rows], dtype=torch.int64, device=device)
            positions = torch.tensor([seqs[row].num_tokens for row in sampled_rows], dtype=torch.int64, device=device)
            drawn = exponential_race(probs.nan_to_num(0.0), seeds, positions)                     # [S]
            for row, ok, token in zip(sampled_rows, usable.tolist(), drawn.tolist()):
                if ok:
                    token_ids[row] = token
                else:
                    errors[row] = "the sampling probabilities are not finite"
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        for j, row in enumerate(wanted):
            if errors[row] is None:
                try:
                    logprobs[row] = self._token_logprob(logp[j], token_ids[row], seqs[row].params.logprobs)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    errors[row] = error_message(exc)
        token_ids = [SampleResult.NO_TOKEN if error is not None else t for t, error in zip(token_ids, errors)]
        return SampleResult(token_ids, logprobs, errors)

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> ProcessedLogits:
        """The batch's logits [B, V] after structured output, min_tokens, logit_bias and the penalties, in
        that order (vLLM's): each a batched op, skipped when no row uses it. `logits` is not changed."""
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
        has_token = torch.isfinite(logits).any(dim=-1).tolist()                   # [B]
        for row, ok in enumerate(has_token):
            if not ok and errors[row] is None:
                errors[row] = ("the logits are not finite" if bool(torch.isnan(logits[row]).any()) else
                               "no token is allowed (structured output, logit_bias and min_tokens forbid them all)")
        return ProcessedLogits(logits, errors)

    @staticmethod
    def _probs(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """Probabilities [S, V] of the sampled rows after temperature, min-p, top-k and top-p."""
        vocab = logits.shape[-1]
        device = logits.device
        params = [seqs[i].params for i in rows]
        temperature = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32, device=device)  # [S]
        top_k = torch.tensor([min(max(p.top_k, 0), vocab) for p in params], dtype=torch.int64, device=device)  # [S]
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device)  # [S]
        min_p = torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device)  # [S]
        index = torch.tensor(rows, device=device)
        scaled = apply_min_p(logits[index] / temperature[:, None], min_p)                    # [S, V]
        return apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)

    @staticmethod
    def _token_logprob(logp: torch.Tensor, token_id: int, n: int) -> TokenLogprob:  # logp [V]
        top_values, top_ids = logp.topk(n) if n else (logp[:0], logp[:0].long())
        return TokenLogprob(
            token_id=token_id,
            logprob=float(logp[token_id]),
            top={int(t): float(v) for t, v in zip(top_ids.tolist(), top_values.tolist())},
        )
