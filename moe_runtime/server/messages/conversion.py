"""A Messages request as the chat request it runs as (`as_chat_request`): the same rendering, tool plan,
structured output and sampling as /v1/chat/completions (`request_conversion.chat_choices`), so the APIs answer
alike.

- `system` leads as a system message;
- an assistant message's text blocks are its content, its thinking blocks its `reasoning_content`, its tool_use
  blocks its `tool_calls` (the input as the arguments' JSON); redacted thinking is dropped (only Anthropic can
  read it);
- a user message's tool_result blocks are tool messages answering their call (`tool_call_id`), its text blocks
  a user message, in the order given (Anthropic puts the results first);
- a final assistant message is a prefill: the answer continues it (chat's `continue_final_message`);
- tool_choice any is chat's "required", tool a named function, none and auto themselves;
  `disable_parallel_tool_use` is `parallel_tool_calls=false`;
- `thinking` reaches the chat template as its thinking switch (`reasoning.request_options`); with thinking
  disabled the answer is read without the reasoning parser (`MessagesConversion.reading`).

Text blocks of one message (and of `system`) are joined with a newline: each block is its own paragraph.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from moe_runtime.server.chat_reading import ChatReading
from moe_runtime.server.errors import bad_request
from moe_runtime.server.harmony_output import HarmonyFormat
from moe_runtime.server.messages.protocol import (MessageParam, MessagesBody, MessagesRequest, TextBlockParam,
                                                  ThinkingBlockParam, ThinkingParam, ToolChoiceParam, ToolParam,
                                                  ToolResultBlockParam, ToolUseBlockParam)
from moe_runtime.server.protocol import ChatCompletionRequest, ChatMessage, FunctionDefinition, ToolDefinition
from moe_runtime.server.reasoning.request_options import thinking_variables
from moe_runtime.server.reasoning.selection import ReasoningChoice
from moe_runtime.server.request_conversion import ChatConversion

BLOCK_SEPARATOR = "\n"
TOOL_ERROR_PREFIX = "Error: "   # a tool_result with is_error: the model reads that the tool failed


@dataclass(frozen=True)
class MessagesConversion:
    chat: ChatConversion
    thinking: bool   # the answer's reasoning is returned as thinking blocks (False: the client disabled thinking)

    def reading(self, reasoning: ReasoningChoice, harmony: HarmonyFormat | None) -> ChatReading:
        """How the answer is read. With thinking disabled, a `<think>` model's text is read without its reasoning
        parser: whatever the model still writes comes back as text, never dropped with a thinking block nobody
        asked for (a template that ignores the switch leaves its parser expecting reasoning first). Harmony's
        reasoning is a channel of its own: its reader stays, and the formatter leaves its thinking out."""
        reading = self.chat.reading(reasoning, harmony)
        return reading if self.thinking else dataclasses.replace(reading, reasoning=None)


def thinking_wanted(thinking: ThinkingParam | None) -> bool | None:
    """The template's thinking switch: on, off, or (adaptive, or not said) as the model likes."""
    if thinking is None or thinking.type == "adaptive":
        return None
    return thinking.type == "enabled"


def shows_thinking(body: MessagesBody) -> bool:
    return thinking_wanted(body.thinking) is not False


def as_chat_request(body: MessagesBody, harmony: bool) -> ChatCompletionRequest:
    """`harmony`: the served model answers in harmony (gpt-oss), whose answer cannot continue a prefill."""
    prefill = body.messages[-1].role == "assistant"
    if prefill:
        check_prefill(body.messages[-1], len(body.messages) - 1, harmony)
    parallel = False if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use else None
    fields = dict(model=body.model, messages=chat_messages(body), tools=chat_tools(body.tools),
                  tool_choice=chat_tool_choice(body.tool_choice), parallel_tool_calls=parallel,
                  chat_template_kwargs=thinking_variables(thinking_wanted(body.thinking)) or None,
                  continue_final_message=prefill)
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream)
    return ChatCompletionRequest(**fields)


def check_prefill(message: MessageParam, index: int, harmony: bool) -> None:
    if harmony:
        raise bad_request("the last message is the assistant's (a prefill), which this model's answer (harmony) "
                          "cannot continue: end with a user message", f"messages.{index}")
    if any(isinstance(block, ToolUseBlockParam) for block in message.content):
        raise bad_request("the last message is the assistant's and calls tools: answer its calls with tool_result "
                          "blocks in a user message", f"messages.{index}")


def chat_messages(body: MessagesBody) -> list[ChatMessage]:
    messages = []
    if body.system:
        messages.append(ChatMessage(role="system", content=joined_text(body.system)))
    for index, message in enumerate(body.messages):
        if message.role == "assistant":
            messages.append(assistant_message(message, index))
        else:
            messages += user_messages(message, index)
    return messages


def joined_text(blocks: list[TextBlockParam]) -> str:
    return BLOCK_SEPARATOR.join(block.text for block in blocks)


def assistant_message(message: MessageParam, index: int) -> ChatMessage:
    texts, thoughts, calls = [], [], []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block)
        elif isinstance(block, ThinkingBlockParam):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlockParam):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlockParam):
            raise bad_request("a tool_result block answers a call: it belongs in a user message",
                              f"messages.{index}.content.{position}")
    return ChatMessage(role="assistant", content=joined_text(texts) if texts or not calls else None,
                       tool_calls=calls or None, reasoning_content=BLOCK_SEPARATOR.join(thoughts) or None)


def user_messages(message: MessageParam, index: int) -> list[ChatMessage]:
    """Tool messages for the tool_result blocks and user messages for the runs of text between them, in order."""
    messages, texts = [], []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block)
        elif isinstance(block, ToolResultBlockParam):
            if texts:
                messages.append(ChatMessage(role="user", content=joined_text(texts)))
                texts = []
            messages.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=tool_result_text(block)))
        elif isinstance(block, ToolUseBlockParam):
            raise bad_request("a tool_use block is a call the assistant made: it belongs in an assistant message",
                              f"messages.{index}.content.{position}")
        # thinking blocks in a user message are nobody's reasoning: dropped
    if texts or not messages:
        messages.append(ChatMessage(role="user", content=joined_text(texts)))
    return messages


def tool_result_text(block: ToolResultBlockParam) -> str:
    text = joined_text(block.content)
    return f"{TOOL_ERROR_PREFIX}{text}" if block.is_error else text


def chat_tools(tools: list[ToolParam] | None) -> list[ToolDefinition] | None:
    if not tools:
        return None
    return [ToolDefinition(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema)) for tool in tools]


def chat_tool_choice(choice: ToolChoiceParam | None) -> str | dict | None:
    """Chat's tool_choice, as chat's validator reads one (a named function as its JSON object)."""
    if choice is None:
        return None
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice {'type': 'tool'} needs the tool's 'name'", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type   # auto, none
