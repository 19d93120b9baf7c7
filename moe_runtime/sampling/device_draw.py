"""A batch's draw while it is still on the device, and the one transfer that brings it to the host.

The sampler leaves everything it decides on the logits' device: the tokens, a status code per row (sampled,
or why not), the logprobs a request asked for. `DeviceDraw.to_host` then moves them with one copy (two when
logprobs were asked), at the end of the step: the one host read a decode step needs, since the scheduler,
stop checks and detokenizer run on the host. Until then nothing waits for the device, so a decode step can
be captured whole and the GPU is never stalled mid-step.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch

from moe_runtime.sampling.logprobs import TokenLogprob


class DrawStatus(IntEnum):
    """Why a row was not sampled; OK when it was. The messages are what the request's error says."""

    OK = 0
    LOGITS_NOT_FINITE = 1
    NO_TOKEN_ALLOWED = 2
    PROBS_NOT_FINITE = 3
    TOO_MANY_LOGPROBS = 4

    @staticmethod
    def message(code: int) -> str | None:
        return {
            DrawStatus.OK: None,
            DrawStatus.LOGITS_NOT_FINITE: "the logits are not finite",
            DrawStatus.NO_TOKEN_ALLOWED: "no token is allowed (structured output, logit_bias and min_tokens forbid "
                                         "them all)",
            DrawStatus.PROBS_NOT_FINITE: "the sampling probabilities are not finite",
            DrawStatus.TOO_MANY_LOGPROBS: "more logprobs asked than the vocabulary has tokens",
        }[DrawStatus(code)]


@dataclass
class SampleResult:
    token_ids: list[int]                       # [B], NO_TOKEN where the row failed
    logprobs: list[TokenLogprob | None]        # [B], None where the request did not ask (or failed)
    errors: list[str | None]                   # [B], why the row could not be sampled; None = sampled
    # [B] speculative decoding: the drafts accepted before each row's token, with their logprobs (None: none)
    accepted: list[list[tuple[int, TokenLogprob | None]]] | None = None

    NO_TOKEN: ClassVar[int] = -1

    def accepted_rows(self) -> list[list[tuple[int, TokenLogprob | None]]]:
        """Each row's accepted drafts ([] for all when none were verified)."""
        return self.accepted if self.accepted is not None else [[] for _ in self.token_ids]

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
                   [e for p in parts for e in p.errors], [a for p in parts for a in p.accepted_rows()])


@dataclass
class TopLogprobs:
    """The logprobs (or logits: `LogprobsMode`) of the rows that asked (`rows`), on the device: each chosen
    token's and the `max(ns)` likeliest, of which row j keeps its own `ns[j]`."""

    rows: list[int]                  # [W] rows of the batch
    ns: list[int]                    # [W] alternatives each asked for
    chosen: torch.Tensor             # [W] float32 logprob of the row's token
    top_values: torch.Tensor         # [W, N] float32, best first
    top_ids: torch.Tensor            # [W, N] int64
    too_many: list[bool]             # [W] asked more alternatives than the vocabulary has

    @classmethod
    def of(cls, scores: torch.Tensor, token_ids: torch.Tensor, rows: list[int], ns: list[int],
           normalize: bool = True) -> "TopLogprobs | None":
        """`scores`: logits [B, V] (the raw ones by default, as vLLM reports logprobs; `Sampler.asked_logprobs`
        picks them), log-softmaxed when `normalize`; the batch's tokens [B]."""
        if not rows:
            return None
        vocab = scores.shape[-1]
        index = torch.tensor(rows, dtype=torch.int64, device=scores.device)                     # [W]
        logp = scores[index]                                                                     # [W, V]
        if normalize:
            logp = logp.log_softmax(dim=-1)
        chosen = logp.gather(1, token_ids[index].clamp(min=0).unsqueeze(1)).squeeze(1)           # [W]
        top_values, top_ids = logp.topk(min(max(ns), vocab), dim=-1)                             # [W, N]
        return cls(rows, ns, chosen, top_values, top_ids, [n > vocab for n in ns])


@dataclass
class DeviceDraw:
    token_ids: torch.Tensor          # [B] int64, on the device
    status: torch.Tensor             # [B] int64 DrawStatus codes, on the device
    errors: list[str | None]         # [B] failures the host already knew (a grammar that could not be set up)
    logprobs: TopLogprobs | None

    def to_host(self) -> SampleResult:
        token_ids, status = torch.stack([self.token_ids, self.status]).tolist()   # one copy: [2, B]
        return self._result(token_ids, status)

    def to_host_beside(self, extra: torch.Tensor) -> tuple[SampleResult, list[int]]:
        """`to_host`, and one more int [B] row of the caller's in the same copy (speculative decoding: which
        rows a sequence's step ends on)."""
        token_ids, status, beside = torch.stack([self.token_ids, self.status, extra.to(torch.int64)]).tolist()
        return self._result(token_ids, status), beside

    def _result(self, token_ids: list[int], status: list[int]) -> SampleResult:
        errors = [known if known is not None else DrawStatus.message(code) for known, code in zip(self.errors, status)]
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            asked = self.logprobs
            chosen, top_values, top_ids = asked.chosen.tolist(), asked.top_values.tolist(), asked.top_ids.tolist()
            for j, row in enumerate(asked.rows):
                if errors[row] is None and asked.too_many[j]:
                    errors[row] = DrawStatus.message(DrawStatus.TOO_MANY_LOGPROBS)
                if errors[row] is None:
                    n = asked.ns[j]
                    logprobs[row] = TokenLogprob(token_ids[row], chosen[j], dict(zip(top_ids[j][:n], top_values[j][:n])))
        token_ids = [SampleResult.NO_TOKEN if error is not None else t for t, error in zip(token_ids, errors)]
        return SampleResult(token_ids, logprobs, errors)
