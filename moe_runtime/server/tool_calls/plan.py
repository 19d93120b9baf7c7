"""How one chat request uses its tools (`plan_tool_use`): what the chat template is shown, whether the
answer is forced into calls through structured output, and how each choice's text is read.

- no tools, or `tool_choice` "none": plain content; the tools are not rendered (so the model is not
  invited to call what it may not call);
- "auto" (the default with tools): the tools are rendered and the answer is read by the model's
  parser, content and calls as the model chooses, and only calls that name an offered function with arguments
  valid for its schema are sent (`offered_tools`; the schemas are checked and their validators built here, off
  the event loop); refused when no parser fits the model;
- "required" / a named function: the answer must be a JSON array of calls matching the tools' schemas
  (`forced_schema`), read without any model family's format, so even a random-weight model returns
  valid calls. Refused together with a `response_format` (one schema per answer).
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec
from moe_runtime.server.errors import bad_request
from moe_runtime.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from moe_runtime.server.tool_calls.call_check import ANY_OBJECT_ARGUMENTS, CallCheck
from moe_runtime.server.tool_calls.forced import ForcedCallsParser
from moe_runtime.server.tool_calls.forced_schema import calls_schema
from moe_runtime.server.tool_calls.forced_stream import ForcedCallStream
from moe_runtime.server.tool_calls.offered_tools import OfferedTools
from moe_runtime.server.tool_calls.parser import SchemaTypedParser, ToolCallParser, openai_call_id_for
from moe_runtime.server.tool_calls.stream import ReadMessage, ToolCallStream, read_message

MAX_CALLS = 16   # calls read from one choice; 1 with parallel_tool_calls=false


@dataclass(frozen=True)
class ToolCallReader:
    """Reads the tool calls of each choice of one request."""

    parser: ToolCallParser
    max_calls: int
    forced: bool = False                      # required / named: the answer is only calls (never content)
    check: CallCheck = ANY_OBJECT_ARGUMENTS   # which calls may be sent (auto: `OfferedTools`)

    def stream(self) -> ToolCallStream | ForcedCallStream:
        if self.forced:
            return ForcedCallStream(self.parser, self.max_calls)
        return ToolCallStream(self.parser, self.max_calls, self.check)

    def read(self, text: str) -> ReadMessage:
        return read_message(self.parser, self.max_calls, text, only_calls=self.forced, check=self.check)


@dataclass(frozen=True)
class ToolUse:
    template_tools: list[dict] | None = None   # given to the chat template as `tools` (None: none rendered)
    forced_schema: str | None = None           # a JSON schema the answer must match (required / named)
    reader: ToolCallReader | None = None       # None: the answer is plain content


PLAIN = ToolUse()


def plan_tool_use(request: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolUse:
    choice, tools = request.tool_choice, request.tools or []
    if not tools:
        if choice in (None, "none", "auto"):
            return PLAIN
        raise bad_request(f"tool_choice={shown(choice)} needs tools: give the functions in 'tools'", "tool_choice")
    if choice == "none":
        return PLAIN
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    max_calls = 1 if request.parallel_tool_calls is False else MAX_CALLS
    if choice in (None, "auto"):
        if parser is None:
            raise bad_request("tool_choice 'auto' needs a tool-call parser, and none fits this model: start moe-serve "
                              "with --tool-call-parser, or ask for tool_choice 'required' or a named function",
                              "tool_choice", "no_tool_call_parser")
        offered = OfferedTools.of(tools)   # first: it refuses a schema the typing below could trip on
        if isinstance(parser, SchemaTypedParser):
            parser = parser.for_tools(template_tools)
        return ToolUse(template_tools, None, ToolCallReader(parser, max_calls, check=offered))
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request(f"tool_choice={shown(choice)} forces the answer into tool calls, which cannot be combined "
                          f"with response_format {request.response_format.type!r}", "tool_choice")
    offered = tools if choice == "required" else named_tool(tools, choice)
    schema = calls_schema(offered, max_calls if choice == "required" else 1)
    if len(schema) > StructuredOutputSpec.MAX_CHARS:
        raise bad_request(f"the tools' parameter schemas make a {len(schema)}-character schema for the forced call, "
                          f"more than {StructuredOutputSpec.MAX_CHARS}", "tools")
    call_ids = parser.new_call_id if parser is not None else openai_call_id_for
    return ToolUse(template_tools, schema, ToolCallReader(ForcedCallsParser(call_ids), max_calls, forced=True))


def named_tool(tools: list[ToolDefinition], choice: NamedToolChoice) -> list[ToolDefinition]:
    named = [tool for tool in tools if tool.function.name == choice.function.name]
    if not named:
        offered = ", ".join(tool.function.name for tool in tools[:8])
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                          f"({offered}{', ...' if len(tools) > 8 else ''})", "tool_choice")
    return named[:1]


def shown(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"{{function: {choice.function.name!r}}}"
    return repr(choice)
