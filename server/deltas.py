"""Turning cumulative engine outputs into the pieces a stream sends: new text, new tokens, new logprobs.

Two things make "new text" subtle. A byte-level tokenizer decodes an incomplete UTF-8 sequence
to U+FFFD, which the next token may complete; and the engine cuts the text before a stop string
only once the whole stop string is there, so a stream that sent its first characters already
could not take them back. Both are held back until the text is final.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.outputs import RequestOutput
from moe_runtime.sequence import TokenLogprob


@dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None          # set on the last delta: "stop" | "length" | "abort"


def held_back_suffix(text: str, stop_strings: list[str]) -> int:
    """Length of the longest end of `text` that starts some stop string (it may yet become one)."""
    longest = 0
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


@dataclass
class ChoiceTracker:
    """What one choice has sent so far; `advance(output)` returns what is new."""

    stop_strings: list[str] = field(default_factory=list)
    sent_text: str = ""
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_reason: str | None = None
    num_tokens: int = 0

    def advance(self, output: RequestOutput) -> ChoiceDelta:
        new_tokens = output.token_ids[self.sent_tokens:]
        self.sent_tokens = len(output.token_ids)
        self.num_tokens = len(output.token_ids)
        new_logprobs: list[TokenLogprob] = []
        if output.logprobs is not None:
            new_logprobs = output.logprobs[self.sent_logprobs:]
            self.sent_logprobs = len(output.logprobs)
        text = output.text
        if not output.finished:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - held_back_suffix(text, self.stop_strings)]
        new_text = ""
        if text.startswith(self.sent_text):
            new_text = text[len(self.sent_text):]
            self.sent_text = text
        if output.finished:
            self.finish_reason = output.finish_reason
        return ChoiceDelta(new_text, new_tokens, new_logprobs, output.finish_reason if output.finished else None)
