"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs.

One request's bad luck stays its own: a row whose probabilities are not finite, or whose draw
raises, gets an error instead of a token and the other rows are sampled as usual. Everything
before the per-row draws is vectorised and consumes no random numbers, so if it raises the
caller can sample each request on its own (`EngineCore`) and seeded requests still draw exactly
what they would have drawn in any other batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moe_runtime.outputs import error_message
from moe_runtime.sequence import Sequence, TokenLogprob

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


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:  # logits [B, V]
        logits = logits.float()
        token_ids = logits.argmax(dim=-1).tolist()                        # [B] the greedy choice
        errors: list[str | None] = [None] * len(seqs)
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        probs = self._probs(logits, seqs, sampled_rows) if sampled_rows else None     # [S, V]
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        logp = logits[wanted].log_softmax(dim=-1) if wanted else None                 # [W, V]
        # nothing above draws a random number: from here on, a failure is one row's alone
        if probs is not None:
            usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()   # [S]
            for j, row in enumerate(sampled_rows):
                if not usable[j]:
                    errors[row] = "the sampling probabilities are not finite"
                    continue
                try:
                    token_ids[row] = int(torch.multinomial(probs[j].cpu(), 1, generator=seqs[row].generator)[0])
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    errors[row] = error_message(exc)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        for j, row in enumerate(wanted):
            if errors[row] is None:
                try:
                    logprobs[row] = self._token_logprob(logp[j], token_ids[row], seqs[row].params.logprobs)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    errors[row] = error_message(exc)
        token_ids = [SampleResult.NO_TOKEN if error is not None else t for t, error in zip(token_ids, errors)]
        return SampleResult(token_ids, logprobs, errors)

    @staticmethod
    def _probs(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """Probabilities [S, V] of the sampled rows after temperature, top-k and top-p."""
        vocab = logits.shape[-1]
        device = logits.device
        params = [seqs[i].params for i in rows]
        temperature = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32, device=device)  # [S]
        top_k = torch.tensor([min(max(p.top_k, 0), vocab) for p in params], dtype=torch.int64, device=device)  # [S]
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device)  # [S]
        index = torch.tensor(rows, device=device)
        scaled = apply_top_k_top_p(logits[index] / temperature[:, None], top_k, top_p)      # [S, V]
        return scaled.softmax(dim=-1)

    @staticmethod
    def _token_logprob(logp: torch.Tensor, token_id: int, n: int) -> TokenLogprob:  # logp [V]
        top_values, top_ids = logp.topk(n) if n else (logp[:0], logp[:0].long())
        return TokenLogprob(
            token_id=token_id,
            logprob=float(logp[token_id]),
            top={int(t): float(v) for t, v in zip(top_ids.tolist(), top_values.tolist())},
        )
