"""Reasoning output (`--reasoning-parser`): the `<think>` parsers on whole and streamed text, and the chat
endpoint's `reasoning_content` (and vLLM's `reasoning`), streamed and whole, with and without tools."""
import json

import pytest
from scripted_chat import ScriptedChatEngine, run_chat, text_pieces
from transformers import AutoTokenizer

from moe_runtime.server.reasoning.parser import ReasoningPiece, split_whole
from moe_runtime.server.reasoning.prompt_state import PromptReasoning, prompt_reasoning
from moe_runtime.server.reasoning.selection import THINK_PARSERS, ReasoningChoiceError, choose_reasoning

pytestmark = pytest.mark.timeout(60)

# (parser, model text, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", "<think>\nStep one.</think>\n\nThe answer.", "\nStep one.", "The answer."),
    ("deepseek_r1", "Step one (the template opened the block).</think>The answer.",
     "Step one (the template opened the block).", "The answer."),
    ("deepseek_r1", "never closed <thi", "never closed <thi", ""),
    ("minimax_m2", "Plan: call it.</think>\n\nDone.", "Plan: call it.", "Done."),
    ("qwen3", "<think>\nx < y, so </thin>k is text</think>\n\nYes.", "\nx < y, so </thin>k is text", "Yes."),
    ("qwen3", "No thinking (enable_thinking false).", "", "No thinking (enable_thinking false)."),
    ("qwen3", "A</think>B", "", "A</think>B"),
    ("qwen3", "  <think>r</think>c", "r", "c"),
    ("qwen3", "<thi", "", "<thi"),
    ("glm45", "<think>GLM thinks.</think>GLM answers.", "GLM thinks.", "GLM answers."),
    ("glm45", "Plain <think> in the middle", "", "Plain <think> in the middle"),
    ("minimax_m2_append_think", "kept</think>\nall content", "", "<think>kept</think>\nall content"),
    ("deepseek_v3", "<think>V3.1 thinks.</think>It answers.", "V3.1 thinks.", "It answers."),
    ("deepseek_v3", "No block: thinking was off.", "", "No block: thinking was off."),
    ("kimi_k2", "<think>K2 thinks.</think>\nK2 answers.", "K2 thinks.", "K2 answers."),
]


# (parser, where the prompt left the block, model text, expected reasoning, expected content)
PROMPT_CASES = [
    ("deepseek_r1", PromptReasoning.CLOSED, "Thinking was off.", "", "Thinking was off."),
    ("deepseek_v3", PromptReasoning.OPEN, "Opened by the template.</think>Answer.", "Opened by the template.",
     "Answer."),
    ("qwen3", PromptReasoning.OPEN, "Qwen3-Thinking's template opened it.</think>\n\nYes.",
     "Qwen3-Thinking's template opened it.", "Yes."),
    ("qwen3", PromptReasoning.CLOSED, "<think>thinks anyway</think>ok", "thinks anyway", "ok"),
    ("minimax_m2_append_think", PromptReasoning.CLOSED, "no block to put back", "", "no block to put back"),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", PROMPT_CASES)
def test_the_prompts_end_decides_where_the_answer_starts(name, prompt, text, reasoning, content):
    assert split_whole(THINK_PARSERS[name], text, prompt) == ReasoningPiece(reasoning, content)


def test_the_prompt_state_is_read_from_the_rendered_prompts_last_tokens(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    for prompt, state in [("<|im_start|>assistant\n<think>\n", PromptReasoning.OPEN),
                          ("<|im_start|>assistant\n<think>\n\n</think>\n\n", PromptReasoning.CLOSED),
                          ("<|im_start|>assistant\n", PromptReasoning.UNSAID)]:
        assert prompt_reasoning(tokenizer, tokenizer.encode(prompt)) is state
    assert prompt_reasoning(None, [1, 2]) is PromptReasoning.UNSAID


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_a_whole_text_splits_into_reasoning_and_content(name, text, reasoning, content):
    assert split_whole(THINK_PARSERS[name], text) == ReasoningPiece(reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_a_text_streamed_in_two_pieces_at_every_boundary_splits_the_same(name, text, reasoning, content):
    for cut in range(len(text) + 1):
        stream = THINK_PARSERS[name].stream()
        piece = stream.feed(text[:cut])
        piece.extend(stream.feed(text[cut:]))
        piece.extend(stream.finish())
        assert piece == ReasoningPiece(reasoning, content), cut


@pytest.mark.parametrize("name", sorted(THINK_PARSERS))
def test_a_text_streamed_one_character_at_a_time_never_leaks_a_tag(name):
    text = "a</think>b" if getattr(THINK_PARSERS[name], "implicit_start", True) else "<think>a</think>b"
    stream = THINK_PARSERS[name].stream()
    pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
    if name == "minimax_m2_append_think":
        assert "".join(p.content for p in pieces) == "<think>" + text
        return
    assert "".join(p.reasoning for p in pieces) == "a" and "".join(p.content for p in pieces) == "b"
    assert not any("<" in p.reasoning + p.content for p in pieces)


def test_reasoning_is_off_by_default_and_gpt_oss_is_harmony_in_any_case():
    assert choose_reasoning(None, "qwen3_moe").parser is None and not choose_reasoning(None, "qwen3_moe").harmony
    assert choose_reasoning("qwen3", "qwen3_moe").parser.name == "qwen3"
    assert choose_reasoning(None, "gpt_oss").harmony and choose_reasoning("gpt_oss", "llama").harmony
    with pytest.raises(ReasoningChoiceError, match="harmony"):
        choose_reasoning("deepseek_r1", "gpt_oss")


# ---- the chat endpoint --------------------------------------------------------------------------------------

ANSWER = ["<th", "ink>\nThe user", " wants 2+2.</th", "ink>", "\n\n", "It is ", "4."]
ASK = [{"role": "user", "content": "2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time now."}}]
CALL_AFTER_THINKING = ["<think>I should call get_time; a <tool_call> here is only a thought.", "</think>\n",
                       "<tool_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}\n</tool_call>"]


def chat(tokenizer_dir, pieces, body=None, **app_kwargs):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    engine = ScriptedChatEngine(tokenizer, text_pieces(pieces))

    async def scenario(client, http):
        request = {"model": "scripted", "messages": ASK, **(body or {})}
        whole = await http.post("/v1/chat/completions", json=request)
        streamed = await http.post("/v1/chat/completions", json={**request, "stream": True})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        sdk = await client.chat.completions.create(**request, stream=True)
        return whole.json(), chunks, [chunk async for chunk in sdk]

    return (*run_chat(engine, scenario, **app_kwargs), engine, tokenizer)


def joined(chunks, key):
    return "".join(choice["delta"].get(key) or "" for chunk in chunks for choice in chunk["choices"])


def test_a_reasoning_parser_returns_reasoning_content_streamed_and_whole(tiny_tokenizer_dir):
    whole, chunks, sdk_chunks, _, _ = chat(tiny_tokenizer_dir, ANSWER, reasoning_parser="qwen3")
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "\nThe user wants 2+2."
    assert message["content"] == "It is 4." and whole["choices"][0]["finish_reason"] == "stop"
    assert joined(chunks, "reasoning_content") == joined(chunks, "reasoning") == "\nThe user wants 2+2."
    assert joined(chunks, "content") == "It is 4."
    assert not any("think>" in json.dumps(chunk) for chunk in chunks)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in sdk_chunks if c.choices)
    assert reasoning == "\nThe user wants 2+2."   # the openai client keeps the extra field


def test_without_the_flag_the_answer_is_todays_content(tiny_tokenizer_dir):
    whole, chunks, _, _, _ = chat(tiny_tokenizer_dir, ANSWER)
    message = whole["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "".join(ANSWER), "tool_calls": None}
    assert joined(chunks, "content") == "".join(ANSWER)
    assert not any("reasoning" in choice["delta"] for chunk in chunks for choice in chunk["choices"])


def test_a_tool_call_after_the_reasoning_is_read_from_the_content_only(tiny_tokenizer_dir):
    whole, chunks, _, _, _ = chat(tiny_tokenizer_dir, CALL_AFTER_THINKING, {"tools": TOOLS},
                                  reasoning_parser="qwen3")
    message = whole["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["reasoning_content"].startswith("I should call get_time")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["message"]["tool_calls"]] == [
        ("get_time", "{}")]
    assert message["message"]["content"] is None
    calls = [call for chunk in chunks for choice in chunk["choices"] for call in choice["delta"].get("tool_calls") or []]
    assert [call["function"]["name"] for call in calls if "name" in call.get("function", {})] == ["get_time"]
    assert "<tool_call>" in joined(chunks, "reasoning_content") and joined(chunks, "content").strip() == ""
    assert [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]
            if choice["finish_reason"]] == ["tool_calls"]


def test_chat_template_kwargs_reach_the_template(tiny_tokenizer_dir):
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    tokenizer.chat_template = template
    engine = ScriptedChatEngine(tokenizer, text_pieces(["Just content."]))

    async def scenario(client, http):
        body = {"model": "scripted", "messages": ASK, "chat_template_kwargs": {"enable_thinking": False,
                                                                               "add_generation_prompt": "ignored"}}
        return (await http.post("/v1/chat/completions", json=body)).json()

    answer = run_chat(engine, scenario, reasoning_parser="qwen3")
    assert answer["choices"][0]["message"]["content"] == "Just content."
    assert tokenizer.decode(engine.prompts[0]).endswith("<think></think>")
