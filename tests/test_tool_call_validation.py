"""Only valid tool calls leave the server: a call must name an offered function and carry arguments that validate
against its schema, else its text is content, from that call on, streamed and whole alike. The schemas are the
client's, so their check is bounded (no regex run, no remote `$ref`, a budget of keyword evaluations) and a schema
that is not JSON Schema is refused with the request."""
import time
import urllib.request

import pytest

from moe_runtime.server.errors import APIError
from moe_runtime.server.harmony_parse import HarmonyStream
from moe_runtime.server.harmony_tokens import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START
from moe_runtime.server.protocol import ChatCompletionRequest, ToolDefinition
from moe_runtime.server.tool_calls.glm45 import Glm45Parser
from moe_runtime.server.tool_calls.hermes import HermesParser
from moe_runtime.server.tool_calls.offered_tools import OfferedTools
from moe_runtime.server.tool_calls.plan import plan_tool_use
from moe_runtime.server.tool_calls.stream import ToolCallStream
from moe_runtime.server.tool_calls.stream_piece import StreamPiece

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}},                                   # no parameters
         {"type": "function", "function": {"name": "anything", "parameters": {}}}]          # any object


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def reader(tools=TOOLS, parser=HermesParser(), **fields):
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                    **fields})
    return plan_tool_use(request, parser).reader


def read_both_ways(tool_reader, text: str):
    """(content, [(name, arguments)]) whole, after asserting that a stream fed 1, 2, 5 characters at a time gives
    the same."""
    whole = tool_reader.read(text)
    calls = [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    for size in (1, 2, 5):
        stream = tool_reader.stream()
        piece = StreamPiece()
        for i in range(0, len(text), size):
            piece.extend(stream.feed(text[i:i + size]))
        piece.extend(stream.finish())
        assert [(c.name, c.arguments) for c in stream.calls] == calls
        blank_with_calls = calls and not piece.content.strip() and whole.content is None   # a whole answer's null
        assert piece.content == (whole.content or "") or blank_with_calls
    return whole.content, calls


@pytest.mark.parametrize("name,arguments", [
    ("get_wether", '{"city": "Paris"}'),                  # not offered
    ("get_weather", '{"city": "Paris", "days": 30}'),     # over the maximum
    ("get_weather", '{"days": 3}'),                       # a required property missing
    ("get_weather", '{"city": "Paris", "extra": 1}'),     # additionalProperties false
    ("get_weather", '{"city": NaN}'),                     # not JSON
    ("get_weather", '"Paris"'),                           # not an object
    ("now", '{"x": 1}'),                                  # no parameters: only {}
])
def test_an_invalid_call_is_content(name, arguments):
    text = "Checking. " + hermes_call(name, arguments)
    assert read_both_ways(reader(), text) == (text, [])


def test_valid_calls_are_sent_including_those_without_parameters():
    text = hermes_call("get_weather", '{"city": "Paris", "days": 3}') + hermes_call("now", "{}") + \
        hermes_call("anything", '{"x": [1]}')
    assert read_both_ways(reader(), text) == (None, [("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}"),
                                                     ("anything", '{"x": [1]}')])


def test_from_an_invalid_call_on_the_rest_is_content():
    valid, invalid = hermes_call("now", "{}"), hermes_call("now", '{"x": 1}')
    rest = "\n" + invalid + "\n" + hermes_call("now", "{}")   # a valid call after the invalid one stays text too
    assert read_both_ways(reader(), "Hi. " + valid + rest) == ("Hi. " + rest, [("now", "{}")])


def test_text_after_the_calls_and_calls_past_the_limit_are_dropped():
    text = hermes_call("now", "{}") + "\nDone, waiting for the result."
    assert read_both_ways(reader(), text) == (None, [("now", "{}")])
    stream = reader().stream()
    stream.feed(text)
    stream.finish()
    assert stream.dropped_text == "\nDone, waiting for the result."
    two = hermes_call("now", "{}") + hermes_call("anything", "{}")
    assert read_both_ways(reader(parallel_tool_calls=False), two) == (None, [("now", "{}")])


def test_a_schema_that_is_not_json_schema_is_refused_with_the_request():
    for parameters in ({"type": "object", "properties": {"a": {"type": "strnig"}}},
                       {"type": "object", "properties": [1]}, {"type": "object", "required": "a"}):
        with pytest.raises(APIError) as refused:
            reader([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
        assert refused.value.status == 400 and refused.value.param == "tools.0.function.parameters"
    reader([{"type": "function", "function": {"name": "f", "parameters": {   # ECMA-only regex syntax: accepted
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^\\p{L}+$"}}}}}])


def test_regexes_are_never_run_so_a_catastrophic_pattern_cannot_hold_the_loop():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^(a+)+$"}},
        "patternProperties": {"^(x+)+$": {"type": "integer"}}, "additionalProperties": False,
        "unevaluatedProperties": False, "propertyNames": {"pattern": "^(b+)+$"}}}}]
    hostile = '{"code": "' + "a" * 64 + '!", "' + "x" * 64 + 'y": "text"}'
    started = time.perf_counter()
    assert read_both_ways(reader(tools), hermes_call("f", hostile))[1] == [("f", hostile)]   # lenient, not wrong
    assert time.perf_counter() - started < 2


def test_a_remote_ref_is_not_fetched_and_fails_the_call(monkeypatch):
    fetched = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda *args, **kwargs: fetched.append(args) or 1 / 0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/schema.json"}}}}}]
    text = hermes_call("f", '{"a": 1}')
    assert read_both_ways(reader(tools), text) == (text, []) and fetched == []


def test_a_schema_that_multiplies_the_work_with_every_level_fails_within_its_budget():
    """Both branches of `anyOf` descend the whole subtree (the first fails only at its own level), so checking a
    value nested d levels deep evaluates 2^d subschemas: the budget cuts it short."""
    node = {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/node"}, "contains": {"const": "never"}},
                      {"type": "array", "items": {"$ref": "#/$defs/node"}}, {"type": "integer"}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"node": node}, "properties": {"x": {"$ref": "#/$defs/node"}}}}}]
    shallow, deep = '{"x": [[[1]]]}', '{"x": ' + "[" * 40 + "1" + "]" * 40 + "}"
    started = time.perf_counter()
    assert read_both_ways(reader(tools), hermes_call("f", shallow))[1] == [("f", shallow)]
    assert read_both_ways(reader(tools), hermes_call("f", deep))[1] == []
    assert time.perf_counter() - started < 5


def test_unique_items_compares_as_json_schema_does_in_linear_time():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]
    check = OfferedTools.of([ToolDefinition.model_validate(tool) for tool in tools])
    assert check.accepts("f", '{"a": [true, 1, {"k": [1]}, {"k": [true]}]}')
    assert not check.accepts("f", '{"a": [1, 1.0]}') and not check.accepts("f", '{"a": [{"x": 1, "y": 2}, {"y": 2, "x": 1}]}')
    # linear, not quadratic: 10x the items may cost ~10x the time (a pairwise comparison would cost 100x); the best
    # of three timings of each size, as a ratio, so a loaded machine slows both sizes alike
    def best_seconds(items: int) -> float:
        body = '{"a": [' + ", ".join(f'{{"n": {i}}}' for i in range(items)) + "]}"
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            assert check.accepts("f", body)
            timings.append(time.perf_counter() - started)
        return min(timings)

    assert best_seconds(20_000) < 30 * best_seconds(2_000)


def test_arguments_a_response_cannot_carry_are_content():
    """GLM re-serializes its values: an escaped lone surrogate becomes a character UTF-8 cannot encode."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>[\"\\ud800\"]</arg_value>\n</tool_call>"
    assert read_both_ways(reader(tools, Glm45Parser()), text) == (text, [])
    escaped = hermes_call("f", '{"a": "\\ud800 \\ud83d\\ude00"}')   # escaped in the JSON text: sendable as it is
    assert read_both_ways(reader(tools), escaped)[1] == [("f", '{"a": "\\ud800 \\ud83d\\ude00"}')]


def test_a_harmony_call_that_fails_the_check_is_its_body_as_content():
    check = OfferedTools.of([ToolDefinition.model_validate(tool) for tool in TOOLS])

    def read(body: str, name: str = "get_weather"):
        stream = HarmonyStream(new_call_id=lambda: "call_x", check=check)
        text = (f"{CHANNEL}analysis{MESSAGE}Thinking.{END}{START}assistant{CHANNEL}commentary to=functions.{name} "
                f"{CONSTRAIN}json{MESSAGE}{body}{CALL}")
        piece = stream.feed(text)
        piece.extend(stream.finish())
        return piece.content, [(c.function.name, c.function.arguments) for c in stream.tool_calls()], stream.called

    assert read('{"city": "Rome"}') == ("", [("get_weather", '{"city": "Rome"}')], True)
    assert read('{"city": 5}') == ('{"city": 5}', [], False)
    assert read('{"city": "Rome"}', "launch") == ('{"city": "Rome"}', [], False)
    assert read("", "now") == ("", [("now", "{}")], True)


def test_a_stream_without_the_request_s_tools_still_sends_only_json_objects():
    stream = ToolCallStream(HermesParser(), 4)
    piece = stream.feed(hermes_call("f", "[1]") + hermes_call("g", "{}"))
    piece.extend(stream.finish())
    assert stream.calls == [] and piece.content.startswith("<tool_call>")
