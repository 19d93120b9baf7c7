"""Kimi K2's (`kimi_k2`) and Qwen3-Coder / Qwen3.5's (`qwen3_coder`) tool-call formats, on strings: whole and
streamed split at every character boundary, several calls, content before them, Kimi's own call ids, Qwen3-Coder's
values typed by the tool schema as vLLM types them, broken or truncated calls staying content, and the parser
choice by flag, chat template and model type."""
import json

import pytest

from moe_runtime.server.protocol import ChatCompletionRequest
from moe_runtime.server.tool_calls.kimi_k2 import KimiK2Parser
from moe_runtime.server.tool_calls.names import TOOL_CALL_PARSER_NAMES
from moe_runtime.server.tool_calls.plan import MAX_CALLS, plan_tool_use
from moe_runtime.server.tool_calls.qwen3_coder import Qwen3CoderParser, qwen3_coder_value
from moe_runtime.server.tool_calls.selection import PARSERS, choose_parser
from moe_runtime.server.tool_calls.stream import read_message
from test_tool_call_parsers import stream_in_pieces
from test_tool_call_parsers_glm_minimax import assert_reads, stream_split_at

ARGS = '{"city": "Paris <|tool_call_end|>", "days": [1, {"a": null}]}'
KIMI_TEXT = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             f"<|tool_call_argument_begin|>{ARGS}<|tool_call_end|>\n<|tool_call_begin|> functions.now:1 "
             "<|tool_call_argument_begin|> {} <|tool_call_end|><|tool_calls_section_end|>")
QWEN_TEXT = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <b>\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n"
             "</tool_call>")
# (parser, text, expected content, expected calls as (name, arguments text))
KNOWN_TEXTS = {
    "kimi_k2": (KimiK2Parser(), KIMI_TEXT, "Let me check.", [("get_weather", ARGS), ("now", "{}")]),
    "kimi_k2_singular_section": (KimiK2Parser(), "<|tool_call_section_begin|><|tool_call_begin|>functions.f:3"
                                 '<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|><|tool_call_section_end|>',
                                 None, [("f", '{"x": 1}')]),
    "qwen3_coder": (Qwen3CoderParser(), QWEN_TEXT, "Let me check.\n",
                    [("get_weather", '{"city": "Paris <b>", "days": "3"}'), ("now", "{}")]),
    "qwen3_coder_bare_function": (Qwen3CoderParser(), "Sure <function=f><parameter=x>1</parameter></function>",
                                  "Sure ", [("f", '{"x": "1"}')]),
    "qwen3_coder_unclosed_parameters": (Qwen3CoderParser(), "<tool_call><function=f><parameter=a>\nx\n<parameter=b>y"
                                        "</function></tool_call>", None, [("f", '{"a": "x", "b": "y"}')]),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"}, "metric": {"type": "boolean"},
    "where": {"type": "object"}, "tags": {"type": "array"}}}}}]


@pytest.mark.parametrize("case", sorted(KNOWN_TEXTS))
def test_known_text_reads_the_same_whole_and_split_anywhere(case):
    parser, text, content, expected = KNOWN_TEXTS[case]
    assert_reads(parser, text, content, expected)
    for cut in range(len(text) + 1):
        streamed_content, calls = stream_split_at(parser, text, cut)
        assert streamed_content.strip() == (content or "").strip(), cut
        assert calls == expected, cut
    streamed_content, calls, deltas = stream_in_pieces(parser, text, 1)
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert len({c["id"] for c in calls}) == len(calls)


def test_kimi_call_ids_are_the_models_functions_name_index():
    whole = read_message(KimiK2Parser(), MAX_CALLS, KIMI_TEXT)
    assert [c.id for c in whole.tool_calls] == ["functions.get_weather:0", "functions.now:1"]
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>f:7<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_call_begin|>functions.f:7<|tool_call_argument_begin|>{}<|tool_call_end|>")
    ids = [c.id for c in read_message(KimiK2Parser(), MAX_CALLS, text).tool_calls]
    assert ids == ["functions.f:7", "functions.f:1"]   # the prefix added; a repeated id replaced (call number 1)


@pytest.mark.parametrize("parser,text", [
    (KimiK2Parser(), "a <|tool_calls_section_begin|>not a call"),
    (KimiK2Parser(), "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"),
    (KimiK2Parser(), "<|tool_call_begin|>functions.f:0 <oops> <|tool_call_argument_begin|>{}<|tool_call_end|>"),
    (KimiK2Parser(), "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|>"),
    (Qwen3CoderParser(), "x <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),   # Hermes' JSON
    (Qwen3CoderParser(), "<tool_call><function=f><parameter=a>1</parameter>stray</function></tool_call>"),
    (Qwen3CoderParser(), "<function=<b>></function>"),
    (Qwen3CoderParser(), "<tool_call><function=f><parameter=a>1</parameter>"),   # truncated
], ids=["kimi-no-call", "kimi-id-without-index", "kimi-id-with-tag", "kimi-not-object", "qwen-hermes-json",
        "qwen-stray-text", "qwen-bad-name", "qwen-truncated"])
def test_text_that_is_not_a_call_stays_content_streamed_and_whole(parser, text):
    whole = read_message(parser, MAX_CALLS, text)
    assert (whole.content, whole.tool_calls) == (text, [])
    content, calls, _ = stream_in_pieces(parser, text, 1)
    assert (content, calls) == (text, [])


def test_qwen3_coder_values_are_typed_by_the_tool_schema_as_vllm_types_them():
    params = {"city": "\n 007 \n", "days": "\n3\n", "ratio": "2.0", "metric": "True", "where": '{"lat": 1}',
              "tags": "['a', 1]", "other": "[1]"}
    body = "".join(f"<parameter={k}>{v}</parameter>" for k, v in params.items())
    parser = Qwen3CoderParser().for_tools(TOOLS)
    [call] = read_message(parser, MAX_CALLS, f"<tool_call><function=get_weather>{body}</function></tool_call>").tool_calls
    assert json.loads(call.function.arguments) == {"city": " 007 ", "days": 3, "ratio": 2, "metric": True,
                                                   "where": {"lat": 1}, "tags": ["a", 1], "other": "[1]"}
    assert qwen3_coder_value("NULL", "string") is None
    assert qwen3_coder_value("12 apples", "integer") == "12 apples"
    assert qwen3_coder_value("inf", "number") == "inf" and qwen3_coder_value("1.5", "float") == 1.5
    assert qwen3_coder_value("yes", "boolean") is False
    assert qwen3_coder_value("{oops", "object") == "{oops" and qwen3_coder_value("{1, 2}", "object") == "{1, 2}"
    assert qwen3_coder_value("9" * 5000, "integer") == "9" * 5000   # longer than Python reads: kept as text


def test_a_request_s_tools_type_qwen3_coder_values():
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    reader = plan_tool_use(request, Qwen3CoderParser()).reader
    [call] = reader.read("<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</function>\n"
                         "</tool_call>").tool_calls
    assert json.loads(call.function.arguments) == {"days": 4}


def test_parser_choice_flag_then_template_then_model_type():
    assert set(PARSERS) == set(TOOL_CALL_PARSER_NAMES) >= {"kimi_k2", "qwen3_coder"}
    assert choose_parser("kimi_k2", None, None) == KimiK2Parser()
    assert choose_parser("qwen3_coder", None, None) == Qwen3CoderParser()
    coder_template = ("{% if tools %}<tool_call>\\n<function={{ name }}>\\n<parameter={{ k }}>\\n{{ v }}"
                      "</parameter>{% endif %}")
    assert choose_parser(None, coder_template, "qwen3_moe") == Qwen3CoderParser()   # not Hermes, whose marker it shares
    kimi_template = "{% if tools %}<|tool_calls_section_begin|>{{ id }}{% endif %}"
    assert choose_parser(None, kimi_template, "kimi_k2") == KimiK2Parser()
    assert choose_parser(None, "{% if tools %}{{ tools | tojson }}{% endif %}", "kimi_k2") == KimiK2Parser()
    assert choose_parser(None, "{% if tools %}{{ tools | tojson }}{% endif %}", "qwen3_5_moe") == Qwen3CoderParser()
    minimax_template = '{% if tools %}<minimax:tool_call><invoke name="x"><parameter name="k">{% endif %}'
    assert choose_parser(None, minimax_template, None) == PARSERS["minimax_m2"]
