"""POST /tokenize and /detokenize in vLLM's shapes: the served model's tokenizer, no engine work.

/tokenize takes a `prompt` (text; special tokens added unless `add_special_tokens` is false) or chat
`messages` (rendered as /v1/chat/completions renders them, with `tools` if given and the assistant
header unless `add_generation_prompt` is false; no special tokens added by default) and returns the
ids, their count and the model's context length, and with `return_token_strs` each id's token string.
/detokenize turns ids back into text. Token lists are bounded (`max_detokenize_tokens`) and every
id must lie inside the tokenizer's vocabulary: a bad one is a 400 naming `tokens`.
"""
from __future__ import annotations

from pydantic import BaseModel, Field

from moe_runtime.server.errors import bad_request, short_repr
from moe_runtime.server.protocol import ChatMessage, MAX_TOOLS, RequestModel, ToolDefinition
from moe_runtime.server.request_conversion import ModelInfo, check_model, render_chat

MIN_DETOKENIZE_BOUND = 2**17   # ids one /detokenize takes: the model's context, and at least this many


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    add_special_tokens: bool | None = None      # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenizer_of(model: ModelInfo, param: str):
    if model.tokenizer is None:
        raise bad_request("this model has no tokenizer", param, "no_tokenizer")
    return model.tokenizer


def tokenize(request: TokenizeRequest, model: ModelInfo) -> TokenizeResponse:
    model.unknown_fields.warn_new(request, "/tokenize")
    check_model(request.model, model)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("give exactly one of 'prompt' (text) and 'messages' (a chat)", "prompt")
    if request.prompt is not None:
        if request.tools is not None:
            raise bad_request("tools are rendered with chat messages only: send 'messages'", "tools")
        tokenizer_of(model, "prompt")   # a 400 naming the prompt without a tokenizer
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        ids = model.encode(request.prompt, "prompt", add_special_tokens=add_special)
    else:
        if request.add_generation_prompt and request.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message exclude each other: set one to false",
                              "continue_final_message")
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        ids = render_chat(request.messages, model, tools, request.add_generation_prompt,
                          request.continue_final_message, bool(request.add_special_tokens))
    token_strs = model.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=token_strs)


def max_detokenize_tokens(model: ModelInfo) -> int:
    return max(model.max_model_len, MIN_DETOKENIZE_BOUND)


def detokenize(request: DetokenizeRequest, model: ModelInfo) -> DetokenizeResponse:
    model.unknown_fields.warn_new(request, "/detokenize")
    check_model(request.model, model)
    tokenizer = tokenizer_of(model, "tokens")
    bound = max_detokenize_tokens(model)
    if len(request.tokens) > bound:
        raise bad_request(f"tokens has {len(request.tokens)} ids, at most {bound}", "tokens")
    vocabulary = len(tokenizer)
    outside = next((t for t in request.tokens if not 0 <= t < vocabulary), None)
    if outside is not None:
        raise bad_request(f"tokens holds id {short_repr(outside)}, outside the vocabulary [0, {vocabulary})", "tokens",
                          "invalid_token_id")
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
