"""Incremental detokenization and stop strings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    text: str      # output text cut before the stop string
    matched: bool
    stop: str | None = None   # the stop string found (Anthropic's `stop_sequence` names it)


def cut_at_stop(text: str, stop_strings: list[str], search_from: int) -> StopMatch:
    """Find the earliest stop string that ends after `search_from` (only new text can complete one)."""
    best = -1
    for stop in stop_strings:
        index = text.find(stop, max(search_from - len(stop) + 1, 0))
        if index != -1 and (best == -1 or index < best):
            best = index
    if best == -1:
        return StopMatch(text, False)
    found = min((stop for stop in stop_strings if text.startswith(stop, best)), key=len)
    return StopMatch(text[:best], True, found)


@dataclass
class DecodeState:
    """Where incremental decoding of one sequence's output stands."""

    prefix_offset: int = 0   # tokens before read_offset decoded again as context (merges across tokens)
    read_offset: int = 0     # tokens whose text is already emitted


class Detokenizer:
    """Text of a growing output, a few tokens at a time: each step decodes a short window, not the
    whole output again (which would cost O(n^2) over a long generation)."""

    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def increment(self, token_ids: list[int], state: DecodeState) -> str:
        """New text since the last call; holds back an incomplete UTF-8 character."""
        before = self.decode(token_ids[state.prefix_offset : state.read_offset])
        window = self.decode(token_ids[state.prefix_offset :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        state.prefix_offset = max(len(token_ids) - self.CONTEXT_TOKENS, state.read_offset)
        state.read_offset = len(token_ids)
        return window[len(before) :]

    @staticmethod
    def stable_prefix(text: str) -> str:
        """Text safe to stream: drop a trailing replacement char of an incomplete UTF-8 sequence."""
        return text.rstrip("\ufffd")
