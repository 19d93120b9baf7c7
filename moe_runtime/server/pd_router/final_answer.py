"""A prefill instance's answer that is already the whole answer, as the client asked for it.

When the first token ends a request (EOS, a stop string or token, or no room for a second token)
the prefill instance answers without a handle: nothing is left to decode, and running the request
again on a decode instance would prefill it twice (and, sampled, could answer differently). The
router returns that answer: as it is (less `kv_transfer_params`), or, to a client that asked for a
stream, as the chunks moe-serve would have streamed (the chat role opening, the one content chunk
with its finish reason, the usage chunk if `stream_options.include_usage`, then `[DONE]`).
"""
from __future__ import annotations

from moe_runtime.server.sse import DONE, sse_data

HEADER_FIELDS = ("id", "created", "model")


def final_body(answer: dict) -> dict:
    return {name: value for name, value in answer.items() if name != "kv_transfer_params"}


def final_events(route: str, answer: dict, client_body: dict) -> list[bytes]:
    """The SSE events of `answer` (a non-streamed completion or chat completion of one choice)."""
    header = {name: answer[name] for name in HEADER_FIELDS if name in answer}
    choices = answer.get("choices") or []
    chunks: list[dict] = []
    if route == "completions":
        header["object"] = "text_completion"
        chunks.append({**header, "choices": [{name: choice.get(name) for name in ("index", "text", "logprobs",
                                                                                 "finish_reason")}
                                             for choice in choices]})
    else:
        header["object"] = "chat.completion.chunk"
        chunks.append({**header, "choices": [{"index": choice.get("index", 0),
                                              "delta": {"role": "assistant", "content": ""}} for choice in choices]})
        chunks.append({**header, "choices": [chat_chunk_choice(choice) for choice in choices]})
    options = client_body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and answer.get("usage") is not None:
        chunks.append({**header, "choices": [], "usage": answer["usage"]})
    return [sse_data(chunk).encode() for chunk in chunks] + [DONE.encode()]


def chat_chunk_choice(choice: dict) -> dict:
    message = choice.get("message") or {}
    delta: dict = {}
    if message.get("content"):
        delta["content"] = message["content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(message["tool_calls"])]
    return {"index": choice.get("index", 0), "delta": delta, "logprobs": choice.get("logprobs"),
            "finish_reason": choice.get("finish_reason")}
