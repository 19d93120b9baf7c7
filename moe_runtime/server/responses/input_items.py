"""A Responses request's `input` as the chat conversation the model is prompted with (`conversation`).

Items and what they become:
- a message (`{"role", "content"}`, with or without `"type": "message"`): a chat message; its content is a
  string or parts (`input_text`, `output_text`, `text`, `refusal`); image, audio and file parts are refused by
  name (text models are served: `protocol.ChatMessage`);
- `function_call` (a call the model made): an assistant message's `tool_calls` entry, `call_id` as its id;
- `function_call_output`: a tool message answering `call_id`;
- `reasoning` (a reasoning item this server returned): the next assistant turn's `reasoning_content`.

Consecutive assistant items (reasoning, text, calls) make one assistant turn, as chat templates expect a
turn's content and calls together. Every refusal names the item: `input[3].content[0]`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from moe_runtime.server.errors import bad_request
from moe_runtime.server.protocol import IMAGE_PART_TYPES, ChatMessage

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text", "refusal"})
UNSERVED_PART_TYPES = IMAGE_PART_TYPES | {"input_audio", "input_file", "file"}


@dataclass
class ConversationBuilder:
    """Chat messages from items, merging one assistant turn's items into one message."""

    messages: list[ChatMessage] = field(default_factory=list)
    _turn: dict | None = None   # the assistant turn being gathered: content, tool_calls, reasoning_content

    def add(self, item: object, where: str) -> None:
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            call = {"id": text_field(item, "call_id", where), "type": "function",
                    "function": {"name": text_field(item, "name", where),
                                 "arguments": text_field(item, "arguments", where)}}
            self._assistant_turn().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            self._close_turn()
            self.messages.append(ChatMessage(role="tool", tool_call_id=text_field(item, "call_id", where),
                                             content=output_text(item.get("output"), f"{where}.output")))
        elif kind == "reasoning":
            reasoning = reasoning_text(item, where)
            if reasoning:
                turn = self._assistant_turn()
                turn["reasoning_content"] = (turn.get("reasoning_content") or "") + reasoning
        else:
            raise bad_request(f"{where} is a {kind!r} item; this server takes message, function_call, "
                              f"function_call_output and reasoning items", f"{where}.type")

    def finish(self) -> list[ChatMessage]:
        self._close_turn()
        return self.messages

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)} (got {role!r})", f"{where}.role")
        text = content_text(item.get("content"), f"{where}.content")
        if role == "assistant":
            turn = self._assistant_turn()
            turn["content"] = (turn.get("content") or "") + text
            return
        self._close_turn()
        self.messages.append(ChatMessage(role=role, content=text))

    def _assistant_turn(self) -> dict:
        if self._turn is None:
            self._turn = {}
        return self._turn

    def _close_turn(self) -> None:
        if self._turn is not None:
            self.messages.append(ChatMessage(role="assistant", content=self._turn.get("content"),
                                             tool_calls=self._turn.get("tool_calls"),
                                             reasoning_content=self._turn.get("reasoning_content")))
            self._turn = None


def conversation(given: str | list[dict], param: str = "input") -> list[ChatMessage]:
    """The chat messages of a request's `input` (a string is one user message)."""
    if isinstance(given, str):
        return [ChatMessage(role="user", content=given)]
    builder = ConversationBuilder()
    for index, item in enumerate(given):
        builder.add(item, f"{param}[{index}]")
    return builder.finish()


def text_field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}")
    return value


def content_text(content: object, where: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNSERVED_PART_TYPES:
            raise bad_request(f"{part_where} is {kind}: only text is served here (the served model's vision or "
                              "audio tower, if it has one, is not loaded)", part_where)
        if kind not in TEXT_PART_TYPES:
            raise bad_request(f"{part_where} must be a text part ({', '.join(sorted(TEXT_PART_TYPES))})", part_where)
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{part_where}.text must be a string", f"{part_where}.text")
        texts.append(text)
    return "".join(texts)


def output_text(output: object, where: str) -> str:
    """A function call's output: a string, text parts, or any JSON value (written as JSON)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(part, dict) and "type" in part for part in output):
        return content_text(output, where)
    if output is None:
        raise bad_request(f"{where} is missing: give the call's result as a string", where)
    return json.dumps(output, ensure_ascii=False)


def reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text (its `content` reasoning_text parts; else its summary)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            texts = [part.get("text") for part in parts if isinstance(part, dict)]
            if not all(isinstance(text, str) for text in texts):
                raise bad_request(f"{where}.{key}[].text must be strings", f"{where}.{key}")
            return "".join(texts)
    return ""
