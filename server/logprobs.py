"""The engine's per-token logprobs in OpenAI's two shapes: completions (legacy) and chat."""
from __future__ import annotations

from moe_runtime.sequence import TokenLogprob
from server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenNamer:
    """Token id -> the text OpenAI shows for it (the token decoded alone; `token_id:N` without a tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            if self.tokenizer is None:
                name = f"token_id:{token_id}"
            else:
                name = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = name
        return name


def completion_logprobs(entries: list[TokenLogprob], namer: TokenNamer, text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry in entries:
        token = namer(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in entry.top.items():  # two ids may show as one text: keep the likelier
            name = namer(token_id)
            top[name] = max(logprob, top.get(name, float("-inf")))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(entries: list[TokenLogprob], namer: TokenNamer) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = namer(entry.token_id)
        top = sorted(entry.top.items(), key=lambda item: -item[1])
        content.append(ChatTokenLogprob(
            token=token,
            logprob=entry.logprob,
            bytes=list(token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=namer(t), logprob=lp, bytes=list(namer(t).encode("utf-8")))
                          for t, lp in top],
        ))
    return ChatLogprobs(content=content)
