"""Tools for a chat template that does not read them: written into the messages, in the Hermes format.

Used when a request offers tools (or replays tool calls) and the checkpoint's template never mentions
`tools`. The tool list becomes a system message (appended to the conversation's own first system
message); an assistant's earlier calls become `<tool_call>` blocks in its text; a tool's result becomes
a user message holding a `<tool_response>` block. The Hermes parser then reads the answer, so a model
that was never trained on tools can still be driven through them, and required/named calls (forced
through structured output) work the same on every template.
"""
from __future__ import annotations

import json

TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_INSTRUCTIONS = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                      "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                      '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_system_text(tools: list[dict]) -> str:
    return TOOLS_PREAMBLE + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + TOOLS_INSTRUCTIONS


def call_text(tool_call: dict) -> str:
    function = tool_call.get("function", tool_call)
    arguments = function.get("arguments", {})
    written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(function.get("name", ""), ensure_ascii=False)}, "arguments": {written}}}\n</tool_call>'


def messages_with_tools_in_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` (as chat templates take them) with the tools and tool-call turns written as plain text."""
    rendered: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(call_text(call) for call in message["tool_calls"])
            rendered.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            rendered.append({key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")})
    if tools:
        block = tools_system_text(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{block}"}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered
