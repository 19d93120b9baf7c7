"""Where the prompt leaves the reasoning block: open, closed, or not said (`PromptReasoning`).

Whether an answer starts inside its reasoning depends on the rendered prompt, not only on the model family:
DeepSeek-V3.1's template ends the prompt with `<think>` when thinking is on and with `</think>` when it is
off, Qwen3's closes an empty block with `enable_thinking: false`, Qwen3-Thinking and Kimi-K2-Thinking open one.
A parser that assumed the family's default would read a no-thinking answer as reasoning (content lost to
the client), so the reading starts where the prompt's end puts it, and falls back to the parser's default
(`implicit_start`) when the prompt's end says nothing.
"""
from __future__ import annotations

import enum

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
TAIL_TOKENS = 8   # the prompt's last tokens decoded to look for a marker (a marker is one token, or a few)


class PromptReasoning(enum.Enum):
    OPEN = "open"          # the prompt ends inside a reasoning block: the answer starts in its reasoning
    CLOSED = "closed"      # the prompt closed the block (thinking off): the answer starts in its content
    UNSAID = "unsaid"      # no marker at the prompt's end: the parser's default


def prompt_reasoning(tokenizer, prompt_token_ids: list[int]) -> PromptReasoning:
    """The state the last tokens of a rendered prompt leave the reasoning block in."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None or not prompt_token_ids:   # no tokenizer (token-id prompts only), or a stand-in without one
        return PromptReasoning.UNSAID
    tail = decode(prompt_token_ids[-TAIL_TOKENS:], skip_special_tokens=False).rstrip()
    if tail.endswith(OPEN_TAG):
        return PromptReasoning.OPEN
    if tail.endswith(CLOSE_TAG):
        return PromptReasoning.CLOSED
    return PromptReasoning.UNSAID
