"""GLM-4.5's (`glm45`) and MiniMax-M2's (`minimax_m2`) tool-call formats, on strings: whole and streamed split at
every character boundary, several calls, content before the calls, values typed as vLLM types them, malformed or
truncated calls staying content, and the parser choice by flag, chat template and model type."""
import json

import pytest

from moe_runtime.server.tool_calls.glm45 import Glm45Parser, glm_value
from moe_runtime.server.tool_calls.minimax_m2 import MiniMaxM2Parser, minimax_value
from moe_runtime.server.tool_calls.names import TOOL_CALL_PARSER_NAMES
from moe_runtime.server.protocol import ChatCompletionRequest
from moe_runtime.server.tool_calls.plan import MAX_CALLS, plan_tool_use
from moe_runtime.server.tool_calls.selection import PARSERS, choose_parser
from moe_runtime.server.tool_calls.stream import ToolCallStream, read_message
from test_tool_call_parsers import stream_in_pieces

GLM_TEXT = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris <b></arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>[1, {\"a\": null}]</arg_value>\n</tool_call>\n"
            "<tool_call>now\n</tool_call>")
MINIMAX_TEXT = ("Let me check.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
                "<parameter name=\"city\">Paris <b></parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n"
                "<invoke name=\"now\">\n</invoke>\n</minimax:tool_call>")
# (parser, text, expected content, expected calls as (name, arguments text))
KNOWN_TEXTS = {
    "glm45": (Glm45Parser(), GLM_TEXT, "Let me check.\n",
              [("get_weather", '{"city": "Paris <b>", "days": [1, {"a": null}]}'), ("now", "{}")]),
    "glm45_no_newline_before_args": (Glm45Parser(), "<tool_call>f<arg_key>x</arg_key><arg_value>true</arg_value></tool_call>",
                                     None, [("f", '{"x": true}')]),
    "minimax_m2": (MiniMaxM2Parser(), MINIMAX_TEXT, "Let me check.\n",
                   [("get_weather", '{"city": "Paris <b>", "days": "3"}'), ("now", "{}")]),
    "minimax_m2_two_sections": (MiniMaxM2Parser(),
                                "<minimax:tool_call><invoke name='a'><parameter name='x'>1</parameter></invoke>"
                                "</minimax:tool_call>\n<minimax:tool_call><invoke name=b></invoke></minimax:tool_call>",
                                None, [("a", '{"x": "1"}'), ("b", "{}")]),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"},
    "ratio": {"type": "number"}, "metric": {"type": "boolean"}, "where": {"type": "object"}}}}}]


def assert_reads(parser, text: str, content, expected) -> None:
    whole = read_message(parser, MAX_CALLS, text)
    assert whole.content == content
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == expected
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in whole.tool_calls)


def stream_split_at(parser, text: str, cut: int):
    """`text` fed in two pieces cut at `cut`: the content and each call as a client assembles it."""
    stream = ToolCallStream(parser, MAX_CALLS)
    pieces = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
    calls: dict[int, list[str]] = {}
    for delta in (d for piece in pieces for d in piece.tool_calls):
        name, arguments = calls.setdefault(delta.index, ["", ""])
        calls[delta.index] = [name + (delta.function.name or ""), arguments + (delta.function.arguments or "")]
    return "".join(p.content for p in pieces), [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("case", sorted(KNOWN_TEXTS))
def test_known_text_reads_the_same_whole_and_split_anywhere(case):
    parser, text, content, expected = KNOWN_TEXTS[case]
    assert_reads(parser, text, content, expected)
    for cut in range(len(text) + 1):
        streamed_content, calls = stream_split_at(parser, text, cut)
        assert streamed_content.strip() == (content or "").strip(), cut
        assert calls == expected, cut
    streamed_content, calls, deltas = stream_in_pieces(parser, text, 1)   # one character at a time
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    for index in range(len(expected)):   # name first (with id and type), then argument fragments only
        own = [d for d in deltas if d.index == index]
        assert own[0].id.startswith("call_") and own[0].type == "function" and own[0].function.name == expected[index][0]
        assert all(d.id is None and d.function.name is None and d.function.arguments for d in own[1:])
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("parser", [Glm45Parser(), MiniMaxM2Parser()], ids=["glm45", "minimax_m2"])
def test_a_call_s_arguments_are_sent_whole_once_it_is_complete(parser):
    """Calls are checked before they are sent, so the arguments come in one delta (not one pair at a time)."""
    _, text, _, expected = KNOWN_TEXTS[parser.name]
    _, _, deltas = stream_in_pieces(parser, text, 1)
    fragments = [d.function.arguments for d in deltas if d.index == 0 and d.function.name is None]
    assert fragments == [expected[0][1]]


@pytest.mark.parametrize("parser,text", [
    (Glm45Parser(), "Is 3 <tool_c... no, 3 < 4."),
    (Glm45Parser(), 'x <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),   # Hermes' JSON, not GLM's tags
    (Glm45Parser(), "<tool_call>get<weather</tool_call>"),
    (MiniMaxM2Parser(), "a <minimax:tool_c and no more"),
    (MiniMaxM2Parser(), "<minimax:tool_call>hello</minimax:tool_call>"),
    (MiniMaxM2Parser(), '<minimax:tool_call><invoke name=""></invoke></minimax:tool_call>'),
], ids=["glm-marker-prefix", "glm-hermes-json", "glm-bad-name", "minimax-marker-prefix", "minimax-no-invoke",
        "minimax-empty-name"])
def test_text_that_is_not_a_call_stays_content_streamed_and_whole(parser, text):
    whole = read_message(parser, MAX_CALLS, text)
    assert (whole.content, whole.tool_calls) == (text, [])
    content, calls, _ = stream_in_pieces(parser, text, 1)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("parser,text", [
    (Glm45Parser(), "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\nstray</tool_call>"),
    (Glm45Parser(), "<tool_call>f\n<arg_key>a</arg_key> no value </tool_call>"),
    (MiniMaxM2Parser(), '<minimax:tool_call><invoke name="f"><param>1</param></invoke></minimax:tool_call>'),
], ids=["glm-stray-text", "glm-key-without-value", "minimax-bad-parameter-tag"])
def test_a_call_broken_after_its_name_is_content_streamed_and_whole(parser, text):
    """Nothing of a call is sent before it is complete and checked, so a break after its name leaves the text as
    content in both readings."""
    whole = read_message(parser, MAX_CALLS, text)
    assert (whole.content, whole.tool_calls) == (text, [])
    stream = ToolCallStream(parser, MAX_CALLS)
    content = "".join(stream.feed(character).content for character in text) + stream.finish().content
    assert (content, stream.calls) == (text, [])


@pytest.mark.parametrize("parser,text", [
    (Glm45Parser(), "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n<arg_va"),
    (MiniMaxM2Parser(), '<minimax:tool_call><invoke name="f"><parameter name="a">x</parameter><parameter name="b">y'),
])
def test_a_truncated_call_is_content_streamed_and_whole(parser, text):
    whole = read_message(parser, MAX_CALLS, text)
    assert whole.content == text and not whole.tool_calls
    assert stream_in_pieces(parser, text, 3)[:2] == (text, [])


@pytest.mark.parametrize("case", ["glm45", "minimax_m2"])
def test_max_calls_keeps_the_first_calls_only(case):
    parser, text, _, expected = KNOWN_TEXTS[case]
    whole = read_message(parser, 1, text)
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == expected[:1]


def test_values_are_typed_by_the_tool_schema_as_vllm_types_them():
    glm = Glm45Parser().for_tools(TOOLS)
    text = ("<tool_call>get_weather\n<arg_key>code</arg_key>\n<arg_value> 7</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value> 3 </arg_value>\n<arg_key>extra</arg_key>\n<arg_value>True</arg_value>"
            "\n</tool_call>")
    [call] = read_message(glm, MAX_CALLS, text).tool_calls
    assert json.loads(call.function.arguments) == {"code": " 7", "days": 3, "extra": True}
    [untyped] = read_message(Glm45Parser(), MAX_CALLS, text).tool_calls   # no schema: every value parsed if it can be
    assert json.loads(untyped.function.arguments)["code"] == 7
    assert glm_value("007", None) == "007"   # neither JSON nor a Python literal
    minimax = MiniMaxM2Parser().for_tools(TOOLS)
    params = {"code": " 007 ", "days": "3", "ratio": "2.0", "metric": "TRUE", "where": '{"lat": 1}', "city": "null",
              "other": "[1]"}
    body = "".join(f'<parameter name="{k}">{v}</parameter>' for k, v in params.items())
    [call] = read_message(minimax, MAX_CALLS, f'<minimax:tool_call><invoke name="get_weather">{body}</invoke>'
                                              "</minimax:tool_call>").tool_calls
    assert json.loads(call.function.arguments) == {"code": "007", "days": 3, "ratio": 2, "metric": True,
                                                   "where": {"lat": 1}, "city": None, "other": "[1]"}


def test_value_conversions_keep_text_where_it_does_not_parse():
    assert glm_value("{1, 2}", None) == "{1, 2}"       # a Python set has no JSON form
    assert glm_value("NaN", None) == "NaN"
    assert glm_value(" plain words ", None) == "plain words"
    assert minimax_value("12 apples", "integer") == "12 apples"
    assert minimax_value("inf", "number") == "inf"
    assert minimax_value("1.5", "number") == 1.5
    assert minimax_value("{oops", "object") == "{oops"


def test_parser_choice_flag_then_template_then_model_type():
    assert set(PARSERS) == set(TOOL_CALL_PARSER_NAMES) >= {"glm45", "minimax_m2"}
    assert choose_parser("glm45", None, None) == Glm45Parser()
    assert choose_parser("minimax_m2", None, None) == MiniMaxM2Parser()
    glm_template = "{% if tools %}<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>{% endif %}"
    assert choose_parser(None, glm_template, "qwen3_moe") == Glm45Parser()   # not Hermes, whose marker it shares
    assert choose_parser(None, "{% if tools %}<minimax:tool_call>{% endif %}", None) == MiniMaxM2Parser()
    assert choose_parser(None, "{% if tools %}{{ tools | tojson }}{% endif %}", "glm4_moe") == Glm45Parser()
    assert choose_parser(None, "{% if tools %}{{ tools | tojson }}{% endif %}", "minimax_m2") == MiniMaxM2Parser()


def test_a_request_s_tools_type_the_values_its_calls_carry():
    """plan_tool_use binds a schema-typed parser to the request's tools: GLM's " 7" for a string parameter stays a
    string, as the schema says, where an unbound parser would read the number 7."""
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": TOOLS})
    reader = plan_tool_use(request, Glm45Parser()).reader
    text = "<tool_call>get_weather\n<arg_key>code</arg_key>\n<arg_value> 7</arg_value>\n</tool_call>"
    [call] = reader.read(text).tool_calls
    assert json.loads(call.function.arguments) == {"code": " 7"}
