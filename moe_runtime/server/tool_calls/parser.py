"""What every tool-call output format implements (`ToolCallParser`), and the pieces they share.

A model writes tool calls in its family's own format after (or instead of) plain content. A parser
answers two questions about the text a choice has produced so far, and nothing else:

- `find_start`: where does the tool-call section begin? Until it is found, the text is content,
  except a tail that could still turn into the section's marker (held back, not streamed yet).
- `scan_call`: what does the call starting at `pos` look like so far? Its name once complete, its
  arguments' JSON text as far as it is certain (it only ever grows), and where it ends once complete.
  What a complete call's scan says must not change as the text grows (a stream sends it then).

`ToolCallStream` (`server.tool_calls.stream`) drives a parser over a growing text and turns the answers
into OpenAI deltas; a whole response is the same stream run once. Parsers keep no state, so one
parser serves every request.
"""
from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace
from moe_runtime.front.output_processor import held_back_suffix


@dataclass(frozen=True)
class SectionStart:
    """Where the tool-call section begins (`index`, None when not in the text yet) and, while it is not,
    how many trailing characters could still begin it (`held`: not content yet)."""

    index: int | None
    held: int = 0


@dataclass(frozen=True)
class CallScan:
    """One tool call as far as the text shows it.

    `name` is None until it is complete; `arguments` is the arguments' JSON text known so far ("" until
    they start), a prefix of the final text; `end` is the index after the call once it is complete;
    `call_id` is the id the model wrote for the call, in formats that write one (Kimi K2).
    """

    name: str | None
    arguments: str
    end: int | None
    call_id: str | None = None


PENDING_CALL = CallScan(None, "", None)   # a call may start here, but the text does not show it yet


class ToolCallParser(Protocol):
    name: str   # as `--tool-call-parser` names it

    def find_start(self, text: str, final: bool) -> SectionStart:
        """Where the tool-call section starts; with `final` (the text is complete) nothing is held back."""
        ...

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        """The call at `text[pos:]` (`pos`: the section's start or the previous call's end), or None when
        no further call starts there. Raises `NotJson` where the text cannot be this format's call."""
        ...

    def new_call_id(self, name: str, index: int) -> str:
        """A fresh id for the call of `name`, the answer's call number `index` (from 0): some chat templates
        require ids of their own format, which may include these."""
        ...


@runtime_checkable
class SchemaTypedParser(Protocol):
    """A parser whose format writes argument values as text (GLM-4.5, MiniMax-M2): it types them by the
    request's tool schemas, as vLLM's parsers for these formats do."""

    def for_tools(self, tools: list[dict]) -> ToolCallParser:
        """This parser typing values by `tools` (the request's, as OpenAI's `tools` entries)."""
        ...


def openai_call_id() -> str:
    """`call_` and 24 hex digits, as OpenAI's ids look."""
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call_id_for(name: str, index: int) -> str:
    """`openai_call_id` as a parser's `new_call_id` (the name and index play no part)."""
    return openai_call_id()


ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def alphanumeric_call_id(length: int = 9) -> str:
    """Mistral's chat templates refuse any tool-call id but exactly 9 letters and digits."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(length))


def find_marker(text: str, markers: tuple[str, ...], final: bool) -> SectionStart:
    """The earliest of `markers` in `text`; if none, hold back the longest tail that begins one of them."""
    found = [index for index in (text.find(marker) for marker in markers) if index >= 0]
    if found:
        return SectionStart(min(found))
    if final:
        return SectionStart(None)
    return SectionStart(None, held_back_suffix(text, list(markers)))


def arguments_start(text: str, pos: int) -> int | None:
    """Where a call's arguments object opens, after whitespace from `pos`; None while the text ends before it.
    Raises `NotJson` if something else than an object follows."""
    start = skip_whitespace(text, pos)
    if start >= len(text):
        return None   # announced once its arguments open: until then it may still not be a call
    if text[start] != "{":
        raise NotJson("the arguments are not a JSON object")
    return start


def expect_literal(text: str, pos: int, literal: str) -> int | None:
    """The index after `literal` if the text continues with it at `pos`; None if the text ends inside it.
    Raises `NotJson` where the text says something else."""
    available = text[pos:pos + len(literal)]
    if available == literal:
        return pos + len(literal)
    if literal.startswith(available):
        return None
    raise NotJson(f"expected {literal!r}")
