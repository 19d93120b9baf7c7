"""The `<think>...</think>` families: DeepSeek-R1, Qwen3, GLM-4.5, MiniMax-M2.

They differ in one thing: whether the chat template already opened the block (`implicit_start`), the default
when the rendered prompt's end does not say (`server.reasoning.prompt_state`: a prompt that ends in `<think>`
or `</think>` decides). DeepSeek-R1's
and MiniMax-M2's templates end the prompt with `<think>`, so the answer starts inside the reasoning and
only `</think>` shows where it ends (vLLM's `deepseek_r1` and `minimax_m2` read it so); an answer that never
closes the block is all reasoning. Qwen3 and GLM-4.5 write `<think>` themselves, and an answer that does
not open with it has no reasoning (`enable_thinking: false`, whose template closes an empty block in the
prompt). Either way a leading `<think>` is dropped, and so is the whitespace between `</think>` and the
content (the models write a blank line there; SGLang drops it too).

`minimax_m2_append_think` is vLLM's other MiniMax reading: no split at all, the content keeps the block
with its `<think>` put back in front, as MiniMax recommends for multi-turn use (the next turn's prompt
must carry the reasoning for the model's interleaved thinking).
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.front.output_processor import held_back_suffix
from moe_runtime.server.reasoning.parser import ReasoningPiece
from moe_runtime.server.reasoning.prompt_state import PromptReasoning

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ThinkTagStream:
    implicit_start: bool
    _pending: str = ""           # text not yet given out
    _phase: str = "opening"      # "opening" (does the answer open a block? not known yet), "reasoning", "content"
    _after_close: bool = False   # whitespace right after </think> is dropped until content shows

    def feed(self, text: str) -> ReasoningPiece:
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> ReasoningPiece:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningPiece:
        piece = ReasoningPiece()
        if self._phase == "opening":
            self._open(final)
            if self._phase == "opening":
                return piece
        if self._phase == "reasoning":
            end = self._pending.find(CLOSE)
            if end < 0:
                keep = 0 if final else held_back_suffix(self._pending, [CLOSE])
                cut = len(self._pending) - keep
                piece.reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return piece
            piece.reasoning = self._pending[:end]
            self._pending = self._pending[end + len(CLOSE):]
            self._phase, self._after_close = "content", True
        text, self._pending = self._pending, ""
        if self._after_close:
            text = text.lstrip()
            self._after_close = not text
        piece.content = text
        return piece

    def _open(self, final: bool) -> None:
        stripped = self._pending.lstrip()
        if stripped.startswith(OPEN):
            self._pending, self._phase = stripped[len(OPEN):], "reasoning"
        elif final or not OPEN.startswith(stripped):   # not (or no longer possibly) an opening tag
            self._phase = "reasoning" if self.implicit_start else "content"


@dataclass(frozen=True)
class ThinkTagParser:
    name: str
    implicit_start: bool   # the chat template opened the block: the answer starts in the reasoning

    def stream(self, prompt: PromptReasoning = PromptReasoning.UNSAID) -> ThinkTagStream:
        """The prompt's end overrides the family's default: an open block starts the answer in its reasoning, a
        closed one (thinking off) in its content, unless the answer opens a block itself."""
        if prompt is PromptReasoning.UNSAID:
            return ThinkTagStream(self.implicit_start)
        return ThinkTagStream(implicit_start=prompt is PromptReasoning.OPEN)


@dataclass
class AppendThinkStream:
    _started: bool = False

    def feed(self, text: str) -> ReasoningPiece:
        prefix = "" if self._started else OPEN
        self._started = True
        return ReasoningPiece(content=prefix + text)

    def finish(self) -> ReasoningPiece:
        return self.feed("")


@dataclass(frozen=True)
class AppendThinkParser:
    """All content, the template's `<think>` put back in front (vLLM's `minimax_m2_append_think`)."""

    name: str

    def stream(self, prompt: PromptReasoning = PromptReasoning.UNSAID) -> AppendThinkStream:
        return AppendThinkStream(_started=prompt is PromptReasoning.CLOSED)   # no block to put back after </think>
