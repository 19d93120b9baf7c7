"""/v1/messages: the Messages API's answer built from a `Generation`'s events, whole or as Anthropic's event stream.

A Messages request has one answer (no `n`): choice 0. Its text is read as chat reads it (`server.chat_reading`:
reasoning, content, tool calls), then shaped as content blocks (`content_blocks`). The stream: message_start
(the message with no content yet, and the prompt's usage), the blocks' events, message_delta (stop reason,
stop sequence, usage), message_stop. A stream that fails sends Anthropic's error event, with the same body as
an error response.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.chat_reading import ChatReading, ChoiceReader
from moe_runtime.server.deltas import ChoiceTracker
from moe_runtime.server.errors import APIError
from moe_runtime.server.generation import ChoiceEvent, Generation
from moe_runtime.server.messages.content_blocks import BlockStream, content_blocks
from moe_runtime.server.messages.protocol import MessageResponse, MessagesUsage, StopReason


def stop_reason(tracker: ChoiceTracker, called_tools: bool) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason, and the stop sequence that ended the answer (if one did)."""
    if tracker.finish_reason == "length":
        return "max_tokens", None
    if tracker.stop_string is not None:
        return "stop_sequence", tracker.stop_string
    return ("tool_use" if called_tools else "end_turn"), None


def usage_of(generation: Generation) -> MessagesUsage:
    """The prompt as Anthropic splits it: computed (`input_tokens`) and read from the prefix cache."""
    cached = generation.cached_prompt_tokens
    return MessagesUsage(input_tokens=generation.prompt_tokens - cached, output_tokens=generation.completion_tokens,
                         cache_read_input_tokens=cached)


@dataclass
class MessagesFormatter:
    generation: Generation
    model_name: str
    reading: ChatReading = ChatReading()
    thinking: bool = True            # reasoning becomes thinking blocks (False: the client disabled thinking)
    _reader: ChoiceReader | None = None
    _blocks: BlockStream = field(default_factory=BlockStream)

    def __post_init__(self) -> None:
        self._reader = self.reading.choice()

    def _message(self, content: list, reason: StopReason | None, sequence: str | None,
                 usage: MessagesUsage) -> MessageResponse:
        return MessageResponse(id=self.generation.request_id, model=self.model_name, content=content,
                               stop_reason=reason, stop_sequence=sequence, usage=usage)

    def _tracker(self) -> ChoiceTracker:
        return self.generation.trackers[self.generation.choices[0].index]

    # streaming
    def opening(self) -> list[dict]:
        """The message, empty; the cache's share of the prompt is known only once the answer runs (message_delta
        says it)."""
        usage = MessagesUsage(input_tokens=self.generation.prompt_tokens, output_tokens=0)
        return [{"type": "message_start", "message": self._message([], None, None, usage).model_dump(mode="json")}]

    def chunks(self, event: ChoiceEvent) -> list[dict]:
        piece = self._reader.feed(event.delta)
        if event.delta.finish_reason is not None:
            piece.extend(self._reader.finish())
        return self._blocks.events(piece, self.thinking)

    def closing(self) -> list[dict]:
        reason, sequence = stop_reason(self._tracker(), self._reader.called)
        return [*self._blocks.close(),
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage_of(self.generation).model_dump(mode="json")},
                {"type": "message_stop"}]

    def failure(self, error: APIError) -> list[dict]:
        return [error.anthropic_body()]

    def error_body(self, error: APIError) -> dict:
        return error.anthropic_body()

    # whole response
    def add(self, event: ChoiceEvent) -> None:
        self._reader.add(event.delta)

    def response(self) -> MessageResponse:
        message = self._reader.message()
        reason, sequence = stop_reason(self._tracker(), bool(message.tool_calls))
        return self._message(content_blocks(message, self.thinking), reason, sequence, usage_of(self.generation))
