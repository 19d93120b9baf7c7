"""gpt-oss's answers through harmony (`HarmonyFormat`): prompts rendered, stop tokens, each choice read.

The engine's front decodes text without special tokens, and harmony's markers are special tokens, so a
choice's harmony reader decodes the choice's token ids itself with them kept (incrementally, the front's
`Detokenizer` over the same ids) and reads that text (`server.harmony_parse`). Stop strings a request
gives still end the generation (the front applies them), but the text read here is the tokens'.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.front.detokenizer import DecodeState, Detokenizer
from moe_runtime.server.deltas import ChoiceDelta
from moe_runtime.server.errors import bad_request
from moe_runtime.server.harmony_parse import HarmonyStream
from moe_runtime.server.harmony_render import REASONING_EFFORTS, HarmonyPrompt
from moe_runtime.server.harmony_tokens import STOPS
from moe_runtime.server.protocol import AssistantMessage, ChatCompletionRequest, ChatMessage
from moe_runtime.server.tool_calls.call_check import ANY_OBJECT_ARGUMENTS, CallCheck
from moe_runtime.server.tool_calls.stream import StreamPiece


class SpecialTokenDetokenizer(Detokenizer):
    """The front's incremental detokenizer, keeping special tokens (harmony's markers) in the text."""

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


@dataclass
class HarmonyChoiceReader:
    """One choice of a harmony answer: streamed pieces (`feed`, `finish`) or, fed whole, its message."""

    detokenizer: SpecialTokenDetokenizer
    stream: HarmonyStream = field(default_factory=HarmonyStream)
    token_ids: list[int] = field(default_factory=list)
    state: DecodeState = field(default_factory=DecodeState)
    _decoded: str = ""
    _reasoning: str = ""
    _content: str = ""
    _finished: bool = False

    @property
    def called(self) -> bool:
        return self.stream.called

    def feed(self, delta: ChoiceDelta) -> StreamPiece:
        self.token_ids += delta.token_ids
        text = self.detokenizer.increment(self.token_ids, self.state)
        self._decoded += text
        return self._kept(self.stream.feed(text))

    def finish(self) -> StreamPiece:
        self._finished = True
        rest = self.detokenizer.decode(self.token_ids)[len(self._decoded):]   # what the increments held back
        piece = self.stream.feed(rest)
        piece.extend(self.stream.finish())
        return self._kept(piece)

    def add(self, delta: ChoiceDelta) -> None:
        self.feed(delta)

    def message(self) -> AssistantMessage:
        if not self._finished:
            self.finish()
        calls = self.stream.tool_calls()
        return AssistantMessage(content=self._content or None, tool_calls=calls or None,
                                reasoning_content=self._reasoning or None, reasoning=self._reasoning or None)

    def _kept(self, piece: StreamPiece) -> StreamPiece:
        self._reasoning += piece.reasoning
        self._content += piece.content
        return piece


@dataclass(frozen=True)
class HarmonyFormat:
    """Harmony for one served model (its tokenizer has the markers as special tokens)."""

    tokenizer: object

    def render(self, messages: list[ChatMessage], tools: list[dict] | None, request: ChatCompletionRequest | None,
               add_generation_prompt: bool = True) -> str:
        effort = None
        if request is not None:
            effort = request.reasoning_effort or (request.chat_template_kwargs or {}).get("reasoning_effort")
        effort = effort or "medium"
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort {effort!r}: gpt-oss takes one of {', '.join(REASONING_EFFORTS)}",
                              "reasoning_effort")
        text = HarmonyPrompt(messages, tools, effort).render()
        return text if add_generation_prompt else text.removesuffix("<|start|>assistant")

    def stop_token_ids(self) -> list[int]:
        """`<|return|>` and `<|call|>`: the answer ends at either (ids from the tokenizer; none it lacks)."""
        ids = []
        for token in STOPS:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != getattr(self.tokenizer, "unk_token_id", None):
                ids.append(token_id)
        return ids

    def reader(self, check: CallCheck = ANY_OBJECT_ARGUMENTS) -> HarmonyChoiceReader:
        """A choice's reader, sending the calls that pass `check` (the request's `ToolCallReader.check`)."""
        return HarmonyChoiceReader(SpecialTokenDetokenizer(self.tokenizer), HarmonyStream(check=check))
