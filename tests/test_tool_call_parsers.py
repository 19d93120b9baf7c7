"""Tool calls read from model text, on strings: each family's parser, streamed and whole, the plan of a request's
tool use (forced schemas, refusals), the parser choice, and the fallback rendering for templates without tools."""
import json

import jsonschema
import pytest

from moe_runtime.server.cli import build_parser, server_config_from_args
from moe_runtime.server.errors import APIError
from moe_runtime.server.protocol import ChatCompletionRequest
from moe_runtime.server.tool_calls import fallback_rendering
from moe_runtime.server.tool_calls.deepseek_v3 import DeepSeekV3Parser
from moe_runtime.server.tool_calls.forced import ForcedCallsParser
from moe_runtime.server.tool_calls.hermes import HermesParser
from moe_runtime.server.tool_calls.json_scan import value_end
from moe_runtime.server.tool_calls.mistral import MistralParser
from moe_runtime.server.tool_calls.names import TOOL_CALL_PARSER_NAMES
from moe_runtime.server.tool_calls.plan import MAX_CALLS, plan_tool_use
from moe_runtime.server.tool_calls.selection import PARSERS, checkpoint_model_type, choose_parser
from moe_runtime.server.tool_calls.stream import ToolCallStream, read_message

WEATHER_ARGS = '{"city": "Par\\"is {x}", "days": [1, {"a": null}]}'
# (parser, text, expected content, expected calls as (name, arguments text))
KNOWN_TEXTS = {
    "hermes": (HermesParser(),
               f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>\n'
               '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
               "Let me look.\n", [("get_weather", WEATHER_ARGS), ("now", "{}")]),
    "deepseek_v3": (DeepSeekV3Parser(),
                    "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    f"{WEATHER_ARGS}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n"
                    "{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    "Sure.", [("get_weather", WEATHER_ARGS), ("now", "{}")]),
    "mistral": (MistralParser(),
                f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}, {{"name": "now", "arguments": {{}}}}]',
                None, [("get_weather", WEATHER_ARGS), ("now", "{}")]),
    "mistral_v11": (MistralParser(), f'Checking [TOOL_CALLS]get_weather[ARGS]{WEATHER_ARGS}[TOOL_CALLS]now[ARGS]{{}}',
                    "Checking ", [("get_weather", WEATHER_ARGS), ("now", "{}")]),
    "mistral_marker_dropped": (MistralParser(), f' [{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}]',
                               None, [("get_weather", WEATHER_ARGS)]),
    "forced": (ForcedCallsParser(), f'[{{"name": "get_weather", "arguments": {WEATHER_ARGS}}},\n {{"name": "now", '
                                    '"arguments": {}}]', None, [("get_weather", WEATHER_ARGS), ("now", "{}")]),
}


def stream_in_pieces(parser, text: str, size: int, max_calls: int = MAX_CALLS):
    """Feed `text` `size` characters at a time; the content, each call as the client assembles it, and the deltas."""
    stream = ToolCallStream(parser, max_calls)
    pieces = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    content = "".join(piece.content for piece in pieces)
    deltas = [delta for piece in pieces for delta in piece.tool_calls]
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
        call["id"] = call["id"] or delta.id
        call["name"] = call["name"] or delta.function.name
        call["arguments"] += delta.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], deltas


@pytest.mark.parametrize("case", sorted(KNOWN_TEXTS))
def test_known_text_reads_the_same_streamed_in_any_pieces_and_whole(case):
    parser, text, content, expected = KNOWN_TEXTS[case]
    whole = read_message(parser, MAX_CALLS, text)
    assert whole.content == content
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == expected
    assert all(json.loads(c.function.arguments) is not None for c in whole.tool_calls)
    for size in (1, 2, 7, len(text)):
        streamed_content, calls, deltas = stream_in_pieces(parser, text, size)
        assert streamed_content.strip() == (content or "").strip()   # a whole answer's blank content is None
        assert [(c["name"], c["arguments"]) for c in calls] == expected, size
        for index in range(len(expected)):   # name first (with id and type), then argument fragments only
            own = [d for d in deltas if d.index == index]
            assert own[0].id and own[0].type == "function" and own[0].function.name == expected[index][0]
            assert all(d.id is None and d.function.name is None and d.function.arguments for d in own[1:])
        assert len({c["id"] for c in calls}) == len(calls)


def test_a_call_is_held_until_complete_then_sent_whole():
    """Each call is checked before it is sent, so nothing of it goes out until it is complete: then its
    announcement and its arguments in one delta."""
    text = KNOWN_TEXTS["hermes"][1]
    first_call_end = text.index("</tool_call>") + len("</tool_call>")
    stream = ToolCallStream(HermesParser(), MAX_CALLS)
    pieces = [stream.feed(character) for character in text]
    assert not any(piece.tool_calls for piece in pieces[:first_call_end - 1])
    sent = pieces[first_call_end - 1].tool_calls
    assert [(d.id is not None, d.function.name, d.function.arguments) for d in sent] == [
        (True, "get_weather", ""), (False, None, WEATHER_ARGS)]


@pytest.mark.parametrize("parser,text", [
    (HermesParser(), "Is 3 <tool_c... no, 3 < 4."),
    (HermesParser(), "x <tool_call>\nnot json</tool_call>"),
    (DeepSeekV3Parser(), "a <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\nno fence"),
    (DeepSeekV3Parser(), "a <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]"),
    (MistralParser(), "[1, 2] is a list"),
    (MistralParser(), "[TOOL_CALLS]bad name![ARGS]{}"),
], ids=["hermes-marker-prefix", "hermes-not-json", "deepseek-no-fence", "deepseek-not-object", "mistral-list",
        "mistral-bad-name"])
def test_text_that_is_not_a_call_stays_content_streamed_and_whole(parser, text):
    assert read_message(parser, MAX_CALLS, text).content == text
    assert not read_message(parser, MAX_CALLS, text).tool_calls
    content, calls, _ = stream_in_pieces(parser, text, 1)
    assert (content, calls) == (text, [])


def test_a_marker_split_over_pieces_is_never_sent_as_content():
    stream = ToolCallStream(HermesParser(), MAX_CALLS)
    assert stream.feed("Hello <tool").content == "Hello "
    piece = stream.feed('_call>{"name": "f", "arguments": {"a"')
    assert (piece.content, piece.tool_calls, stream.calls) == ("", [], [])   # held until the call is complete
    piece = stream.feed(': 1}}</tool_call>')
    assert [(d.function.name, d.function.arguments) for d in piece.tool_calls] == [("f", ""), (None, '{"a": 1}')]


def test_a_truncated_call_is_content_streamed_and_whole():
    """Cut by max_tokens, a call cannot be used: streamed, nothing of it was sent (calls are held until complete),
    so both readings give its text as content."""
    text = 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    whole = read_message(HermesParser(), MAX_CALLS, text)
    assert whole.content == text and not whole.tool_calls
    assert stream_in_pieces(HermesParser(), text, 3)[:2] == (text, [])


def test_max_calls_keeps_the_first_calls_only():
    parser, text, _, expected = KNOWN_TEXTS["hermes"]
    whole = read_message(parser, 1, text)
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == expected[:1]


def test_mistral_call_ids_fit_its_templates():
    whole = read_message(MistralParser(), MAX_CALLS, KNOWN_TEXTS["mistral"][1])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in whole.tool_calls)
    assert all(c.id.startswith("call_") for c in read_message(HermesParser(), MAX_CALLS, KNOWN_TEXTS["hermes"][1]).tool_calls)


def test_value_end_knows_when_a_prefix_is_complete():
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end('{"a": "\\"}', 0) is None
    assert value_end("[1, [2, 3]]", 0) == 11
    assert value_end("12", 0) is None and value_end("12,", 0) == 2


# ---- what a request asks of its tools -------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}},
    {"type": "function", "function": {"name": "now"}},
]


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_required_forces_a_list_of_calls_to_any_tool():
    use = plan_tool_use(chat_request(tools=TOOLS, tool_choice="required"), HermesParser())
    schema = json.loads(use.forced_schema)
    assert use.template_tools == TOOLS and isinstance(use.reader.parser, ForcedCallsParser)
    jsonschema.validate([{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"unit": "c"}}], schema)
    for wrong in ([], [{"name": "get_weather", "arguments": {"unit": "k"}}], [{"name": "other", "arguments": {}}],
                  [{"name": "now", "arguments": {"x": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = json.loads(plan_tool_use(chat_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                                      HermesParser()).forced_schema)
    assert single["maxItems"] == 1


def test_a_named_choice_forces_exactly_one_call_of_that_function():
    named = {"type": "function", "function": {"name": "get_weather"}}
    use = plan_tool_use(chat_request(tools=TOOLS, tool_choice=named), None)   # no parser needed
    schema = json.loads(use.forced_schema)
    jsonschema.validate([{"name": "get_weather", "arguments": {"unit": "f"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"unit": "f"}}] * 2, schema)


def test_auto_and_none():
    auto = plan_tool_use(chat_request(tools=TOOLS), HermesParser())
    assert auto.forced_schema is None and auto.reader.parser == HermesParser() and auto.template_tools == TOOLS
    none = plan_tool_use(chat_request(tools=TOOLS, tool_choice="none"), HermesParser())
    assert none.template_tools is None and none.reader is None
    assert plan_tool_use(chat_request(), None).reader is None


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS}, "tool_choice"),                                          # auto with no parser for the model
    ({"tool_choice": "required"}, "tool_choice"),                               # no tools to call
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "description": "x" * 70_000}}}], "tool_choice": "required"}, "tools"),
], ids=["auto-without-parser", "required-without-tools", "unknown-name", "with-response-format", "schema-too-long"])
def test_refusals_name_the_parameter(fields, param):
    with pytest.raises(APIError) as refused:
        plan_tool_use(chat_request(**fields), None)
    assert refused.value.status == 400 and refused.value.param == param


def test_parser_choice_flag_then_template_then_model_type():
    assert set(PARSERS) == set(TOOL_CALL_PARSER_NAMES)
    assert choose_parser("mistral", "{{ '<tool_call>' }} {{ tools }}", "qwen2") == MistralParser()
    assert choose_parser(None, "{% if tools %}<tool_call>{% endif %}", "deepseek_v3") == HermesParser()
    assert choose_parser(None, "{% if tools %}<｜tool▁calls▁begin｜>{% endif %}", None) == DeepSeekV3Parser()
    assert choose_parser(None, "{% if tools %}[TOOL_CALLS]{% endif %}", None) == MistralParser()
    assert choose_parser(None, "{{ messages }}", None) == HermesParser()   # no tool support: the Hermes fallback
    assert choose_parser(None, "{% if tools %}{{ tools | tojson }}{% endif %}", "qwen3_moe") == HermesParser()
    assert choose_parser(None, "{% if tools %}{{ tools | tojson }}{% endif %}", "llama") is None


def test_fallback_rendering_writes_what_the_hermes_parser_reads():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    rendered = fallback_rendering.messages_with_tools_in_text(messages, TOOLS)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "now"' in rendered[0]["content"]
    assert rendered[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in rendered)
    replayed = read_message(HermesParser(), MAX_CALLS, rendered[2]["content"])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in replayed.tool_calls] == \
        [("get_weather", {"unit": "c"})]


def test_the_flag_reaches_the_server_config_and_the_model_type_comes_from_config_json(tmp_path):
    args = build_parser().parse_args(["--tool-call-parser", "mistral"])
    assert server_config_from_args(args).tool_call_parser == "mistral"
    assert server_config_from_args(build_parser().parse_args([])).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "llama3_json"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert checkpoint_model_type(tmp_path) == "deepseek_v3"
    assert checkpoint_model_type(tmp_path / "missing") is None
