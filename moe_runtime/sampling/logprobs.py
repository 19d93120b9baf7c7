"""Logprobs as the engine reports them: of sampled tokens (`TokenLogprob`) and of prompt tokens
(`PromptLogprobs`, in columns of plain numbers, and `PromptTokenLogprob`, one entry per token)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # top-N alternatives: token id -> logprob


@dataclass
class PromptTokenLogprob(TokenLogprob):
    """A prompt token's logprob given the tokens before it, and its rank in the vocabulary (1 = likeliest)."""

    rank: int


@dataclass
class PromptLogprobs:
    """The logprobs of prompt tokens 1..P-1, each given the tokens before it (token 0 has none), in columns
    of plain numbers: it crosses the control plane once, in a request's first `TokenDelta`.

    `top_*` hold each position's N likeliest tokens (N = `SamplingParams.prompt_logprobs`; 0 = none), best first.
    """

    token_ids: list[int]                 # [P-1] prompt tokens 1..P-1
    logprobs: list[float]                # [P-1]
    ranks: list[int]                     # [P-1] 1-based rank of the token among the whole vocabulary
    top_token_ids: list[list[int]]       # [P-1][N]
    top_logprobs: list[list[float]]      # [P-1][N]

    def entries(self) -> list[PromptTokenLogprob | None]:
        """One entry per prompt token, None for the first (nothing precedes it), as vLLM gives them."""
        entries: list[PromptTokenLogprob | None] = [None]
        for token_id, logprob, rank, top_ids, top_values in zip(self.token_ids, self.logprobs, self.ranks,
                                                                self.top_token_ids, self.top_logprobs):
            entries.append(PromptTokenLogprob(token_id, logprob, dict(zip(top_ids, top_values)), rank))
        return entries
