"""Prompt lookup (n-gram) drafting: a sequence that repeats its context is likely to go on as it did before.

vLLM's rule: the longest suffix of the tokens so far (between `prompt_lookup_min` and `prompt_lookup_max`
tokens) that also occurs earlier in the prompt + output, its latest such occurrence, and the (up to k)
tokens that followed it there. Runs on the host over token ids: no model, no device work.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramDrafter:
    min_n: int
    max_n: int

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` drafts to follow `tokens` (none: no suffix of at least `min_n` tokens occurred before)."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        last = tokens[-1]
        best_n, best_end = 0, -1              # match length, and the index just past the earlier occurrence
        for end in range(length - 2, -1, -1):  # latest occurrence first: ties keep it
            if tokens[end] != last:
                continue
            n = 1
            while n < self.max_n and end - n >= 0 and tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end + 1
                if n == self.max_n:
                    break
        if best_n < self.min_n:
            return []
        return tokens[best_end : best_end + k]
