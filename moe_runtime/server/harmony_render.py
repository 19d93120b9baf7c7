"""A chat conversation rendered in harmony, gpt-oss's chat format, as text ending in `<|start|>assistant`.

openai-harmony renders it to tokens, but needs the o200k vocabulary, which it downloads on first use (no
network: it cannot load), so the text format of OpenAI's harmony guide is written here and the model's
tokenizer (which has the markers as special tokens) encodes it.

- a system message the server writes: who the model is, the knowledge cutoff, today's date, the
  reasoning effort (`reasoning_effort`: low, medium (default), high), the valid channels, and with tools
  where their calls go;
- the request's system and developer messages, as the developer message's `# Instructions`, followed
  by the tools as TypeScript types in the `functions` namespace (`server.harmony_schema`);
- user turns; an assistant's content on the `final` channel; its tool calls on `commentary` addressed
  `to=functions.NAME` with JSON arguments, each ending in `<|call|>`, after its reasoning (kept only
  before calls: harmony drops the chain of thought of finished turns); tool results from
  `functions.NAME to=assistant` on `commentary`, the name found from the call they answer.
"""
from __future__ import annotations

import datetime
import json
from dataclasses import dataclass

from moe_runtime.server.harmony_schema import functions_namespace
from moe_runtime.server.harmony_tokens import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START
from moe_runtime.server.protocol import ChatMessage

REASONING_EFFORTS = ("low", "medium", "high")
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"


@dataclass(frozen=True)
class HarmonyPrompt:
    messages: list[ChatMessage]
    tools: list[dict] | None = None
    reasoning_effort: str = "medium"
    today: datetime.date | None = None    # None: today's date (UTC)

    def render(self) -> str:
        parts = [self._system(), self._developer()]
        call_names: dict[str, str] = {}
        for message in self.messages:
            if message.role == "user":
                parts.append(block("user", None, message.text(), END))
            elif message.role == "assistant":
                parts.append(assistant_turn(message, call_names))
            elif message.role == "tool":
                name = call_names.get(message.tool_call_id or "", message.name or "tool")
                parts.append(block(f"functions.{name} to=assistant", "commentary", message.text(), END))
        return "".join(part for part in parts if part) + START + "assistant"

    def _system(self) -> str:
        today = self.today or datetime.datetime.now(datetime.timezone.utc).date()
        lines = [IDENTITY, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}", f"Current date: {today.isoformat()}", "",
                 f"Reasoning: {self.reasoning_effort}", "",
                 "# Valid channels: analysis, commentary, final. Channel must be included for every message."]
        if self.tools:
            lines.append("Calls to these tools must go to the commentary channel: 'functions'.")
        return block("system", None, "\n".join(lines), END)

    def _developer(self) -> str:
        instructions = "\n\n".join(m.text() for m in self.messages if m.role in ("system", "developer") and m.text())
        sections = [f"# Instructions\n\n{instructions}"] if instructions else []
        if self.tools:
            sections.append("# Tools\n\n" + functions_namespace(self.tools))
        return block("developer", None, "\n\n".join(sections), END) if sections else ""


def block(header: str, channel: str | None, body: str, end: str) -> str:
    channel_part = f"{CHANNEL}{channel}" if channel else ""
    return f"{START}{header}{channel_part}{MESSAGE}{body}{end}"


def assistant_turn(message: ChatMessage, call_names: dict[str, str]) -> str:
    parts = []
    calls = message.tool_calls or []
    reasoning = message.reasoning_content or message.reasoning
    if calls and reasoning:
        parts.append(block("assistant", "analysis", reasoning, END))
    if message.text():
        parts.append(block("assistant", "commentary" if calls else "final", message.text(), END))
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        if isinstance(call.get("id"), str):
            call_names[call["id"]] = function["name"]
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
        parts.append(f"{START}assistant{CHANNEL}commentary to=functions.{function['name']} {CONSTRAIN}json"
                     f"{MESSAGE}{arguments}{CALL}")
    return "".join(parts)
