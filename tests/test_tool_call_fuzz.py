"""Every tool-call reader against hostile model output, seeded (the same cases on every run).

For each `--tool-call-parser` format, the forced (structured-output) reading and harmony's: well-formed calls
(content before them; strings with unicode, emoji, right-to-left marks, escaped surrogates and, where the format
keeps strings as JSON, every format's markers), cut at every position; calls that name no offered function or
break their schema (a maximum, a missing or extra property, repeated unique items, NaN, an integer longer than
Python reads, nesting deeper than it recurses); and texts mutated at random (markers inserted or repeated, slices
deleted or doubled, random bytes as a detokenizer decodes them). Each text is read whole and streamed in random
chunk sizes, and:

- nothing raises;
- every call sent names an offered function, and its arguments are a JSON object valid for that function's
  schema (checked here with jsonschema as it comes; the regex the server never runs is left out);
- streamed and whole give the same calls and the same content;
- a call's deltas are its announcement (id, type, name) then its arguments;
- nothing is lost: the text is the content before the calls, the calls' text, then the rest as content or as
  the dropped tail after the calls (`ToolCallStream`; harmony's markers are not content, so not checked there);
- well-formed calls read back as written, and from a broken call on nothing more is called.
"""
from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import jsonschema
import pytest

from moe_runtime.server.harmony_parse import HarmonyStream
from moe_runtime.server.harmony_tokens import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from moe_runtime.server.protocol import ChatCompletionRequest
from moe_runtime.server.tool_calls import deepseek_v3, glm45, hermes, kimi_k2, minimax_m2, mistral, qwen3_coder
from moe_runtime.server.tool_calls.forced import ForcedCallsParser
from moe_runtime.server.tool_calls.names import TOOL_CALL_PARSER_NAMES
from moe_runtime.server.tool_calls.plan import MAX_CALLS, ToolCallReader, plan_tool_use
from moe_runtime.server.tool_calls.selection import PARSERS
from moe_runtime.server.tool_calls.stream_piece import StreamPiece

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
    "city": {"type": "string", "minLength": 1}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["c", "f"]}}}
SEARCH = {"type": "object", "required": ["query"], "properties": {
    "query": {"type": "string"}, "filters": {"type": "object"}, "limit": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
GREP = {"type": "object", "required": ["pattern"], "properties": {   # a parameter named "pattern", and a ReDoS regex
    "pattern": {"type": "string", "pattern": "^(a+)+$"}, "path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
         {"type": "function", "function": {"name": "grep", "parameters": GREP}},
         {"type": "function", "function": {"name": "now"}}]
REFERENCE_SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "now": {"type": "object", "additionalProperties": False},
                     "grep": {**GREP, "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}}}}

MARKERS = (hermes.OPEN, hermes.CLOSE, deepseek_v3.CALLS_BEGIN, deepseek_v3.CALL_BEGIN, deepseek_v3.SEPARATOR,
           deepseek_v3.CALL_END, deepseek_v3.CALLS_END, "```json", "```", mistral.MARKER, mistral.ARGS,
           glm45.KEY_OPEN, glm45.KEY_CLOSE, glm45.VALUE_OPEN, glm45.VALUE_CLOSE, minimax_m2.SECTION_OPEN,
           minimax_m2.SECTION_CLOSE, '<invoke name="now">', minimax_m2.INVOKE_CLOSE, '<parameter name="city">',
           minimax_m2.PARAMETER_CLOSE, *kimi_k2.SECTION_BEGINS, *kimi_k2.SECTION_ENDS, kimi_k2.CALL_BEGIN,
           kimi_k2.ARGUMENT_BEGIN, kimi_k2.CALL_END, "functions.now:0", "<function=now>", qwen3_coder.FUNCTION_CLOSE,
           "<parameter=city>", qwen3_coder.PARAMETER_CLOSE, START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN,
           "to=functions.now", "[{", '{"name": "now", "arguments": {}}', "]", "}")
# harmony's markers are special tokens, which no string in the text can hold (its reader decodes them as text)
STRING_MARKERS = tuple(marker for marker in MARKERS if not marker.startswith("<|") or "tool" in marker)
UNICODE = ("é", "日本語", "😀", "👩\u200d👩\u200d👧", "مرحبا", "שלום", "\u202e", "\u200f", "\u2028", "ﬁ", "𝔘", "\u0301")
PLAIN = "abcdefghij klmnopqrstuvwxyz ABCXYZ 0123456789 .,;:!?-_()'+*/=%&@#"
WRONG_NAMES = ("get_wether", "launch", "now ", "Now", "functions.now", "search<", "")


@dataclass(frozen=True)
class Call:
    """A call to render; `raw`, if given, is written as is as one more value of the arguments (to break them)."""

    name: str
    arguments: dict
    raw: str | None = None


@dataclass
class Reading:
    """What one reading of a text gave."""

    content: str
    calls: list[tuple[str, str]]
    reasoning: str = ""
    deltas: list = field(default_factory=list)
    stream: object = None


# ---- random values ---------------------------------------------------------------------------------------------

def text_piece(rng: random.Random, json_strings: bool) -> str:
    kind = rng.random()
    if kind < 0.45:
        return "".join(rng.choice(PLAIN) for _ in range(rng.randint(1, 8)))
    if kind < 0.8:
        return rng.choice(UNICODE)
    if json_strings:   # what only a JSON string can hold: markers, quotes, escapes, a lone surrogate
        return rng.choice(STRING_MARKERS + ('"', "\\", "\n", "\t", "\ud800", "\udfff", "{", "}", "<", "</"))
    return rng.choice(("&amp;", "'", '"', "{", "}", "[", "]", "\\"))


def random_string(rng: random.Random, json_strings: bool, min_length: int = 0) -> str:
    """A string value. For formats that write values as tag text it holds no tag, no surrounding whitespace and is
    not "null" (what those formats strip or read differently), so it reads back as written."""
    while True:
        value = "".join(text_piece(rng, json_strings) for _ in range(rng.randint(0, 5)))
        if not json_strings:
            value = value.strip()
        if len(value) >= min_length and (json_strings or value.lower() != "null"):
            return value


def random_json(rng: random.Random, json_strings: bool, depth: int) -> object:
    kind = rng.randrange(7 if depth > 0 else 5)
    if kind == 0:
        return random_string(rng, json_strings)
    if kind == 1:
        return rng.choice([0, -1, 7, 2 ** 70, -(2 ** 63)])
    if kind == 2:
        return rng.choice([0.5, -2.25, 1e300, 3.0e-7])
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return [random_json(rng, json_strings, depth - 1) for _ in range(rng.randint(0, 3))]
    return {random_string(rng, json_strings): random_json(rng, json_strings, depth - 1) for _ in range(rng.randint(0, 3))}


def valid_call(rng: random.Random, json_strings: bool) -> Call:
    name = rng.choice(["get_weather", "search", "grep", "now"])
    if name == "now":
        return Call(name, {})
    if name == "get_weather":
        arguments = {"city": random_string(rng, json_strings, 1)}
        if rng.random() < 0.6:
            arguments["days"] = rng.randint(1, 7)
        if rng.random() < 0.4:
            arguments["unit"] = rng.choice(["c", "f"])
        return Call(name, arguments)
    if name == "grep":
        return Call(name, {"pattern": "a" * rng.randint(1, 40) + rng.choice(["", "!"]), "path": random_string(rng, json_strings)})
    arguments = {"query": random_string(rng, json_strings)}
    if rng.random() < 0.5:
        arguments["filters"] = {random_string(rng, json_strings): random_json(rng, json_strings, 4)
                                for _ in range(rng.randint(0, 3))}
    if rng.random() < 0.4:
        arguments["tags"] = sorted({random_string(rng, json_strings) for _ in range(rng.randint(0, 4))})
    if rng.random() < 0.4:
        arguments["limit"] = rng.choice([1, 2.5, 1e300, -7])
    return Call(name, arguments)


def invalid_call(rng: random.Random) -> Call:
    """A call no format can read as valid (each reading types values differently, so only such breaks count)."""
    return rng.choice([
        Call(rng.choice(WRONG_NAMES), {"city": "Paris"}),
        Call("get_weather", {"city": "Paris", "days": rng.choice([0, 8, 99])}),
        Call("get_weather", {"days": 3}),
        Call("get_weather", {"city": "Paris", "extra": "1"}),
        Call("now", {"x": "1"}),
        Call("search", {"query": "q", "tags": ["a", "a"]}),
        Call("get_weather", {"city": "Paris"}, raw="9" * 5000),               # an integer Python will not read
        Call("get_weather", {"city": "Paris"}, raw="NaN"),
        Call("search", {"query": "q"}, raw="[" * 5000 + "]" * 5000),           # deeper than Python recurses
    ])


# ---- each format's writing -------------------------------------------------------------------------------------

def dumped(value: object, rng: random.Random) -> str:
    """JSON text; escaped to ASCII at random, and always where a lone surrogate must be (a model's text is UTF-8)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return json.dumps(value) if rng.random() < 0.3 else text


def json_arguments(call: Call, rng: random.Random) -> str:
    if call.raw is None:
        return dumped(call.arguments, rng)
    if call.name == "search":
        return '{"query": "q", "filters": {"deep": ' + call.raw + "}}"
    return '{"city": "Paris", "days": ' + call.raw + "}"


def tagged_values(call: Call, string_params: set[str]) -> list[tuple[str, str]]:
    """(key, value text) as the XML-tagged formats write them: strings as they are, anything else as JSON."""
    pairs = [(key, value if key in string_params and isinstance(value, str) else json.dumps(value, ensure_ascii=False))
             for key, value in call.arguments.items()]
    if call.raw is not None:
        pairs.append(("filters" if call.name == "search" else "days", call.raw))
    return pairs


STRING_PARAMS = {"city", "query", "pattern", "path", "unit"}


def render_hermes(calls: list[Call], rng: random.Random) -> str:
    return "\n".join(f'<tool_call>\n{{"name": {json.dumps(call.name)}, "arguments": {json_arguments(call, rng)}}}\n'
                     "</tool_call>" for call in calls)


def render_deepseek(calls: list[Call], rng: random.Random) -> str:
    body = "\n".join(f"{deepseek_v3.CALL_BEGIN}function{deepseek_v3.SEPARATOR}{call.name}\n```json\n"
                     f"{json_arguments(call, rng)}\n```{deepseek_v3.CALL_END}" for call in calls)
    return deepseek_v3.CALLS_BEGIN + body + deepseek_v3.CALLS_END


def render_mistral(calls: list[Call], rng: random.Random) -> str:
    if rng.random() < 0.5:
        items = ", ".join(f'{{"name": {json.dumps(call.name)}, "arguments": {json_arguments(call, rng)}}}'
                          for call in calls)
        return f"{mistral.MARKER}[{items}]"
    return "".join(f"{mistral.MARKER}{call.name}{mistral.ARGS}{json_arguments(call, rng)}" for call in calls)


def render_glm(calls: list[Call], rng: random.Random) -> str:
    return "\n".join(f"<tool_call>{call.name}\n" + "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"
                                                          for key, value in tagged_values(call, STRING_PARAMS))
                     + "</tool_call>" for call in calls)


def render_minimax(calls: list[Call], rng: random.Random) -> str:
    invokes = "".join(f'<invoke name="{call.name}">\n' + "".join(f'<parameter name="{key}">{value}</parameter>\n'
                                                                for key, value in tagged_values(call, STRING_PARAMS))
                      + "</invoke>\n" for call in calls)
    return f"{minimax_m2.SECTION_OPEN}\n{invokes}{minimax_m2.SECTION_CLOSE}"


def render_kimi(calls: list[Call], rng: random.Random) -> str:
    body = "".join(f"{kimi_k2.CALL_BEGIN}functions.{call.name}:{index}{kimi_k2.ARGUMENT_BEGIN}"
                   f"{json_arguments(call, rng)}{kimi_k2.CALL_END}" for index, call in enumerate(calls))
    return kimi_k2.SECTION_BEGINS[0] + body + kimi_k2.SECTION_ENDS[0]


def render_qwen3_coder(calls: list[Call], rng: random.Random) -> str:
    return "\n".join(f"<tool_call>\n<function={call.name}>\n" + "".join(f"<parameter={key}>\n{value}\n</parameter>\n"
                                                                       for key, value in tagged_values(call, STRING_PARAMS))
                     + "</function>\n</tool_call>" for call in calls)


def render_forced(calls: list[Call], rng: random.Random) -> str:
    return "[" + ", ".join(f'{{"name": {json.dumps(call.name)}, "arguments": {json_arguments(call, rng)}}}'
                           for call in calls) + "]"


def render_harmony(calls: list[Call], rng: random.Random) -> str:
    return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{call.name} {CONSTRAIN}json{MESSAGE}"
                   f"{json_arguments(call, rng)}{CALL}" for call in calls)


RENDERERS: dict[str, Callable[[list[Call], random.Random], str]] = {
    "hermes": render_hermes, "deepseek_v3": render_deepseek, "mistral": render_mistral, "glm45": render_glm,
    "minimax_m2": render_minimax, "kimi_k2": render_kimi, "qwen3_coder": render_qwen3_coder,
    "forced": render_forced, "harmony": render_harmony}
TAGGED = {"glm45", "minimax_m2", "qwen3_coder"}   # values written as tag text: strings hold no tags
HARMONY_LEAD = f"{CHANNEL}analysis{MESSAGE}Thinking about it.{END}{START}assistant{CHANNEL}commentary{MESSAGE}"


def content_before(rng: random.Random, name: str) -> str:
    """Text before the calls; a letter first (Mistral reads an answer opening with `[{` as its calls)."""
    if name == "forced" or rng.random() < 0.3:
        return ""
    return "W" + "".join(text_piece(rng, False) for _ in range(rng.randint(0, 6)))


def written_text(rng: random.Random, name: str, calls: list[Call]) -> tuple[str, str]:
    """(the whole text, the content before the calls)."""
    before = content_before(rng, name)
    if name == "harmony":
        return HARMONY_LEAD + before + END + RENDERERS[name](calls, rng), before
    return before + RENDERERS[name](calls, rng), before


# ---- readings ----------------------------------------------------------------------------------------------------

def request_reader(name: str, max_calls: int) -> ToolCallReader:
    """The reader a request with `TOOLS` gets (for harmony, whose stream reads the calls, only its `check` counts)."""
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                    "parallel_tool_calls": max_calls > 1})
    if name == "forced":
        return ToolCallReader(ForcedCallsParser(), max_calls, forced=True)
    return plan_tool_use(request, PARSERS["hermes" if name == "harmony" else name]).reader


def chunks(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        size = rng.choice([1, 1, 2, 3, 5, 8, 13, 40])
        pieces.append(text[i:i + size])
        i += size
    return pieces


def read(name: str, reader: ToolCallReader, pieces: list[str]) -> Reading:
    stream = HarmonyStream(check=reader.check) if name == "harmony" else reader.stream()
    piece = StreamPiece()
    for text in pieces:
        piece.extend(stream.feed(text))
    piece.extend(stream.finish())
    calls = [(call.name, call.arguments) for call in stream.calls]
    return Reading(piece.content, calls, piece.reasoning, piece.tool_calls, stream)


def read_whole(name: str, reader: ToolCallReader, text: str) -> Reading:
    if name == "harmony":
        return read(name, reader, [text])
    message = reader.read(text)
    return Reading(message.content or "", [(call.function.name, call.function.arguments) for call in message.tool_calls])


# ---- what every reading must satisfy -----------------------------------------------------------------------------

def assert_sound(name: str, reader: ToolCallReader, text: str, rng: random.Random,
                 grammar_shaped: bool = True) -> Reading:
    """The checks of the module's docstring. A forced answer's calls are not checked (the grammar makes them
    valid): it is only never content, and read the same whole and streamed where the grammar could have written
    the text (a forced stream announces a call once its name is complete, and JSON broken after that, which the
    grammar rules out, leaves the announced call standing)."""
    whole = read_whole(name, reader, text)
    streamed = read(name, reader, chunks(rng, text))
    if name == "forced":
        assert streamed.content == whole.content == "", text
        assert streamed.calls == whole.calls or not grammar_shaped, text
        return whole
    assert streamed.calls == whole.calls, text
    assert streamed.reasoning == whole.reasoning, text
    assert streamed.content == whole.content or \
        (whole.calls and not streamed.content.strip() and whole.content == ""), text   # blank content with calls: null
    for call_name, arguments in whole.calls:
        assert call_name in REFERENCE_SCHEMAS, text
        value = json.loads(arguments)
        assert isinstance(value, dict), text
        jsonschema.validate(value, REFERENCE_SCHEMAS[call_name])
        arguments.encode("utf-8")
    assert_delta_shapes(streamed)
    if name != "harmony":
        assert_nothing_lost(text, streamed)
    return whole


def assert_delta_shapes(reading: Reading) -> None:
    by_index: dict[int, list] = {}
    for delta in reading.deltas:
        by_index.setdefault(delta.index, []).append(delta)
    assert sorted(by_index) == list(range(len(reading.calls)))
    ids = set()
    for index, (name, arguments) in enumerate(reading.calls):
        first, *rest = by_index[index]
        assert first.id and first.type == "function" and first.function.name == name and first.function.arguments == ""
        assert all(d.id is None and d.type is None and d.function.name is None for d in rest)
        assert "".join(d.function.arguments for d in rest) == arguments
        ids.add(first.id)
    assert len(ids) == len(reading.calls)


def assert_nothing_lost(text: str, reading: Reading) -> None:
    stream = reading.stream
    if stream.section_start is None or not reading.calls:
        assert reading.content == text
        return
    head = text[:stream.section_start]
    assert reading.content.startswith(head)
    assert head + stream.calls_text + reading.content[len(head):] + stream.dropped_text == text


def parsed(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return [(call_name, json.loads(arguments)) for call_name, arguments in calls]


# ---- the cases ----------------------------------------------------------------------------------------------------

FORMATS = [*TOOL_CALL_PARSER_NAMES, "forced", "harmony"]


def format_rng(name: str, salt: str) -> random.Random:
    return random.Random(zlib.crc32(f"{name}/{salt}".encode()))


@pytest.mark.parametrize("name", FORMATS)
def test_well_formed_calls_read_back_and_every_cut_of_them_is_sound(name):
    rng = format_rng(name, "well-formed")
    reader = request_reader(name, MAX_CALLS)
    for sample in range(60):
        calls = [valid_call(rng, name not in TAGGED) for _ in range(rng.randint(1, 3))]
        text, before = written_text(rng, name, calls)
        whole = assert_sound(name, reader, text, rng)
        assert parsed(whole.calls) == [(call.name, call.arguments) for call in calls], text
        if name not in ("forced", "harmony"):
            assert whole.content == before, text
        if sample < 2:   # every cut (max_tokens) of the first texts
            for cut in range(len(text)):
                assert_sound(name, reader, text[:cut], rng)


@pytest.mark.parametrize("name", FORMATS)
def test_from_a_broken_call_on_nothing_more_is_called(name):
    rng = format_rng(name, "broken")
    reader = request_reader(name, MAX_CALLS)
    for _ in range(12 if name == "forced" else 60):   # a forced stream rescans a long call on every update: slow
        json_strings = name not in TAGGED
        good = [valid_call(rng, json_strings) for _ in range(rng.randint(0, 2))]
        after = [valid_call(rng, json_strings) for _ in range(rng.randint(0, 2))]
        text, _ = written_text(rng, name, good + [invalid_call(rng)] + after)
        whole = assert_sound(name, reader, text, rng)
        if name == "forced":
            continue   # the grammar keeps forced calls valid: they are not checked
        expected = good + after if name == "harmony" else good   # harmony's messages each stand alone
        assert parsed(whole.calls) == [(call.name, call.arguments) for call in expected], text


def mutated(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(text))
        operation = rng.randrange(6)
        if operation == 0:
            text = text[:at] + rng.choice(MARKERS) * rng.randint(1, 3) + text[at:]
        elif operation == 1:
            text = text[:at] + text[at + rng.randint(1, 30):]
        elif operation == 2:
            text = text[:at] + text[at:at + rng.randint(1, 60)] + text[at:]
        elif operation == 3:
            noise = bytes(rng.randrange(256) for _ in range(rng.randint(1, 12))).decode("utf-8", errors="replace")
            text = text[:at] + noise + text[at:]
        elif operation == 4:
            text = text[:at] + rng.choice(UNICODE + ('"', "\\", "{", "}", "[", "]", ":", ",", "\n")) + text[at:]
        else:
            text = text[:at]
    return text


@pytest.mark.parametrize("name", FORMATS)
def test_mutated_and_random_texts_are_sound(name):
    rng = format_rng(name, "mutated")
    readers = [request_reader(name, MAX_CALLS), request_reader(name, 1)]
    for _ in range(40 if name == "forced" else 120):   # a forced stream rescans a long call on every update: slow
        calls = [valid_call(rng, name not in TAGGED) if rng.random() < 0.8 else invalid_call(rng)
                 for _ in range(rng.randint(1, 3))]
        text, _ = written_text(rng, name, calls)
        assert_sound(name, rng.choice(readers), mutated(rng, text), rng, grammar_shaped=False)
    for _ in range(20):   # markers alone, repeated and unterminated
        text = "".join(rng.choice(MARKERS + UNICODE + ("x", " ", "\n")) for _ in range(rng.randint(1, 12)))
        assert_sound(name, readers[0], text, rng, grammar_shaped=False)


def test_every_format_is_fuzzed():
    assert set(RENDERERS) == set(FORMATS)
