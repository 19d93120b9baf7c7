"""What a reasoning parser answers (`ReasoningParser`): how one choice's text divides into reasoning and content.

The split is made on text as it grows (`ReasoningStream`), one stream per choice, so a marker cut across
two stream deltas (token boundaries fall anywhere) is held back until it is whole or proven not to be
one. A whole response goes through the same stream once (`split_whole`): streamed and whole answers agree.
Tool calls are read from the content part only (`server.chat_reading`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from moe_runtime.server.reasoning.prompt_state import PromptReasoning


@dataclass
class ReasoningPiece:
    """What one update adds: reasoning text and content text (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def extend(self, other: "ReasoningPiece") -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningStream(Protocol):
    def feed(self, text: str) -> ReasoningPiece:
        """The reasoning and content `text` adds, less a tail that may still be part of a marker."""
        ...

    def finish(self) -> ReasoningPiece:
        """The held-back rest, once the text is complete."""
        ...


class ReasoningParser(Protocol):
    name: str   # as `--reasoning-parser` names it

    def stream(self, prompt: PromptReasoning = PromptReasoning.UNSAID) -> ReasoningStream:
        """A fresh split of one choice's text (parsers keep no state: one parser serves every request), starting
        where the prompt left the reasoning block (`server.reasoning.prompt_state`)."""
        ...


def split_whole(parser: ReasoningParser, text: str, prompt: PromptReasoning = PromptReasoning.UNSAID) -> ReasoningPiece:
    """A complete text's reasoning and content, through the same stream a streamed answer uses."""
    stream = parser.stream(prompt)
    piece = stream.feed(text)
    piece.extend(stream.finish())
    return piece
