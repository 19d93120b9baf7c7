"""Harmony (gpt-oss's chat format): prompts rendered as OpenAI's harmony guide writes them, answers read into
reasoning_content, content and tool calls, whole and streamed, and the chat endpoint of a `gpt_oss` model."""
import datetime
import json

import pytest
from scripted_chat import ScriptedChatEngine, run_chat
from transformers import AutoTokenizer

from moe_runtime.server.harmony_parse import HarmonyStream, parse_header
from moe_runtime.server.harmony_render import HarmonyPrompt
from moe_runtime.server.harmony_tokens import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from moe_runtime.server.protocol import ChatMessage
from moe_runtime.server.tool_calls.stream import StreamPiece

pytestmark = pytest.mark.timeout(60)

DAY = datetime.date(2025, 6, 28)
WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["location"]}}}
LOCATION = {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}}

# The harmony guide's example prompt with function tools (its system message, instructions and tools).
GUIDE_PROMPT = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nUse a friendly tone.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n// Gets the location of the user.\ntype get_location = () => any;\n\n"
    "// Gets the current weather in the provided location.\ntype get_current_weather = (_: {\n"
    "// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
    "format?: \"celsius\" | \"fahrenheit\", // default: celsius\n}) => any;\n\n} // namespace functions<|end|>"
    "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant")


def test_a_prompt_with_instructions_and_tools_renders_as_the_guide_shows():
    messages = [ChatMessage(role="system", content="Use a friendly tone."),
                ChatMessage(role="user", content="What is the weather like in SF?")]
    assert HarmonyPrompt(messages, [LOCATION, WEATHER], "high", DAY).render() == GUIDE_PROMPT


def test_a_tool_round_trip_renders_the_call_its_reasoning_and_the_result():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_current_weather", "arguments": "{\"location\":\"San Francisco\"}"}}
    messages = [ChatMessage(role="user", content="Weather in SF?"),
                ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content="Need the tool."),
                ChatMessage(role="tool", tool_call_id="call_1", content="{\"sunny\": true}")]
    text = HarmonyPrompt(messages, [WEATHER], "medium", DAY).render()
    assert text.endswith(
        "<|start|>user<|message|>Weather in SF?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json"
        "<|message|>{\"location\":\"San Francisco\"}<|call|>"
        "<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>{\"sunny\": true}<|end|>"
        "<|start|>assistant")
    assert "Reasoning: medium" in text


def test_without_tools_or_instructions_there_is_no_developer_message():
    text = HarmonyPrompt([ChatMessage(role="user", content="Hi")], None, "low", DAY).render()
    assert "developer" not in text and "'functions'" not in text and "Reasoning: low" in text


REASONED = (f"{CHANNEL}analysis{MESSAGE}User asks 2+2. Simple.{END}"
            f"{START}assistant{CHANNEL}final{MESSAGE}2 + 2 = 4.{RETURN}")
CALLING = (f"{CHANNEL}analysis{MESSAGE}Need weather; call the tool.{END}"
           f"{START}assistant{CHANNEL}commentary{MESSAGE}Checking.{END}"
           f"{START}assistant{CHANNEL}commentary to=functions.get_current_weather {CONSTRAIN}json"
           f"{MESSAGE}{{\"location\": \"SF\"}}{CALL}")


def read(pieces: list[str]) -> tuple[StreamPiece, HarmonyStream]:
    stream = HarmonyStream(new_call_id=lambda: "call_x")
    piece = StreamPiece()
    for text in pieces:
        piece.extend(stream.feed(text))
    piece.extend(stream.finish())
    return piece, stream


def arguments(piece: StreamPiece) -> str:
    return "".join(delta.function.arguments or "" for delta in piece.tool_calls if delta.function)


def test_channels_go_to_reasoning_content_and_calls():
    piece, _ = read([REASONED])
    assert (piece.reasoning, piece.content, piece.tool_calls) == ("User asks 2+2. Simple.", "2 + 2 = 4.", [])
    piece, stream = read([CALLING])
    assert (piece.reasoning, piece.content) == ("Need weather; call the tool.", "Checking.")
    assert [(c.function.name, c.function.arguments) for c in stream.tool_calls()] == [("get_current_weather", "{\"location\": \"SF\"}")]
    assert arguments(piece) == "{\"location\": \"SF\"}"


@pytest.mark.parametrize("text", [REASONED, CALLING], ids=["final", "call"])
def test_a_text_streamed_in_two_pieces_at_every_boundary_reads_the_same(text):
    whole, _ = read([text])
    for cut in range(len(text) + 1):
        piece, _ = read([text[:cut], text[cut:]])
        assert (piece.reasoning, piece.content, arguments(piece)) == (whole.reasoning, whole.content,
                                                                      arguments(whole)), cut
        assert not any("<|" in part for part in (piece.reasoning, piece.content)), cut


def test_headers_with_the_recipient_before_the_channel_and_cut_calls():
    assert parse_header(" to=functions.f<|channel|>commentary json") == parse_header(
        "assistant<|channel|>commentary to=functions.f <|constrain|>json")
    assert parse_header("<|channel|>analysis").target == "reasoning"
    assert parse_header("<|channel|>commentary to=browser.search").target == "reasoning"
    piece, stream = read([f"{CHANNEL}commentary to=functions.get_location{MESSAGE}"])   # stopped at <|call|>, kept out
    assert [(c.function.name, c.function.arguments) for c in stream.tool_calls()] == [("get_location", "{}")]
    piece, _ = read(["[{\"plain\": \"json\"}]"])   # structured output: no harmony at all
    assert piece.content == "[{\"plain\": \"json\"}]"


# ---- the chat endpoint of a gpt_oss model -------------------------------------------------------------------

MARKERS = [START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN]


def harmony_tokenizer(tokenizer_dir):
    """The tiny tokenizer with harmony's markers as special tokens (as gpt-oss's tokenizer has them)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tokenizer.add_tokens(MARKERS, special_tokens=True)
    return tokenizer


def token_pieces(tokenizer, text: str) -> list[tuple[str, list[int]]]:
    """One token per step, its text decoded without special tokens, as the engine's front sends it."""
    return [(tokenizer.decode([token], skip_special_tokens=True), [token]) for token in tokenizer.encode(text)]


def serve(tokenizer_dir, answer: str, body: dict):
    tokenizer = harmony_tokenizer(tokenizer_dir)
    engine = ScriptedChatEngine(tokenizer, token_pieces(tokenizer, answer))

    async def scenario(client, http):
        request = {"model": "scripted", "messages": [{"role": "user", "content": "Weather in SF?"}], **body}
        whole = await http.post("/v1/chat/completions", json=request)
        streamed = await http.post("/v1/chat/completions", json={**request, "stream": True})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        return whole.json(), chunks

    whole, chunks = run_chat(engine, scenario, model_type="gpt_oss")
    return whole, chunks, engine, tokenizer


def joined(chunks, key):
    return "".join(choice["delta"].get(key) or "" for chunk in chunks for choice in chunk["choices"])


def test_a_gpt_oss_chat_is_rendered_in_harmony_and_answers_with_reasoning_content(tiny_tokenizer_dir):
    whole, chunks, engine, tokenizer = serve(tiny_tokenizer_dir, REASONED, {"reasoning_effort": "low"})
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == (
        "User asks 2+2. Simple.", "User asks 2+2. Simple.", "2 + 2 = 4.")
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert joined(chunks, "reasoning_content") == "User asks 2+2. Simple." and joined(chunks, "content") == "2 + 2 = 4."
    prompt = tokenizer.decode(engine.prompts[0], skip_special_tokens=False)
    assert "Reasoning: low" in prompt and prompt.endswith("<|start|>user<|message|>Weather in SF?<|end|><|start|>assistant")
    assert set(tokenizer.convert_tokens_to_ids([RETURN, CALL])) <= set(engine.stop_token_ids[0])


def test_a_gpt_oss_tool_call_after_its_reasoning_is_an_openai_tool_call(tiny_tokenizer_dir):
    whole, chunks, engine, tokenizer = serve(tiny_tokenizer_dir, CALLING, {"tools": [WEATHER]})
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need weather; call the tool."
    assert choice["message"]["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_current_weather", "{\"location\": \"SF\"}")]
    deltas = [call for chunk in chunks for c in chunk["choices"] for call in c["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "get_current_weather" and deltas[0]["id"].startswith("call_")
    assert "".join(d["function"].get("arguments", "") for d in deltas) == "{\"location\": \"SF\"}"
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["tool_calls"]
    prompt = tokenizer.decode(engine.prompts[0], skip_special_tokens=False)
    assert "type get_current_weather = (_: {" in prompt


def test_an_unknown_reasoning_effort_is_refused_by_name(tiny_tokenizer_dir):
    whole, _, _, _ = serve(tiny_tokenizer_dir, REASONED, {"reasoning_effort": "extreme"})
    assert whole["error"]["param"] == "reasoning_effort"
