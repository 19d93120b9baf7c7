"""Incremental detokenization and stop strings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    text: str      # output text cut before the stop string
    matched: bool


def cut_at_stop(text: str, stop_strings: list[str], search_from: int) -> StopMatch:
    """Find the earliest stop string that ends after `search_from` (only new text can complete one)."""
    best = -1
    for stop in stop_strings:
        index = text.find(stop, max(search_from - len(stop) + 1, 0))
        if index != -1 and (best == -1 or index < best):
            best = index
    if best == -1:
        return StopMatch(text, False)
    return StopMatch(text[:best], True)


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @staticmethod
    def stable_prefix(text: str) -> str:
        """Text safe to stream: drop a trailing replacement char of an incomplete UTF-8 sequence."""
        return text.rstrip("\ufffd")
