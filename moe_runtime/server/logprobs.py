"""The engine's per-token logprobs in OpenAI's two shapes, completions (legacy) and chat; prompt logprobs in
the completions shape (echo) and in vLLM's `prompt_logprobs` shape."""
from __future__ import annotations

from moe_runtime.sampling.logprobs import PromptTokenLogprob, TokenLogprob
from moe_runtime.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob

LOWEST_SHOWN_LOGPROB = -9999.0   # JSON has no -inf: what a token the processed distribution drops shows (vLLM's)


class TokenNamer:
    """Token id -> the text OpenAI shows for it (the token decoded alone; `token_id:N` without a tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())   # BOS, EOS, ...

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            if self.tokenizer is None:
                name = f"token_id:{token_id}"
            else:
                name = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = name
        return name


def json_safe(entry: TokenLogprob) -> TokenLogprob:
    """`entry` with its -inf values (tokens `--logprobs-mode processed_*` reports as dropped by top-k, top-p,
    min-p or a grammar) raised to `LOWEST_SHOWN_LOGPROB`, which JSON can carry."""
    def shown(value: float) -> float:
        return max(value, LOWEST_SHOWN_LOGPROB)
    return TokenLogprob(entry.token_id, shown(entry.logprob), {t: shown(v) for t, v in entry.top.items()})


def completion_logprobs(entries: list[TokenLogprob], namer: TokenNamer, text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text. Each position's
    `top_logprobs` holds the sampled token too, as OpenAI's do (so up to logprobs + 1 entries, and the
    sampled token alone with `logprobs: 0`)."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry in map(json_safe, entries):
        token = namer(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        top = top_by_name(entry.top, namer)
        top.setdefault(token, entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def top_by_name(top: dict[int, float], namer: TokenNamer, limit: int | None = None) -> dict[str, float]:
    """The first `limit` (all: None) alternatives of `top` (best first) by text; two ids may show as one
    text: the likelier is kept."""
    named: dict[str, float] = {}
    for token_id, logprob in list(top.items())[:limit]:
        name = namer(token_id)
        named[name] = max(logprob, named.get(name, float("-inf")))
    return named


def echoed_prompt_logprobs(prompt_token_ids: list[int], entries: list[PromptTokenLogprob | None],
                           namer: TokenNamer, num_top: int, echoed_text: str) -> CompletionLogprobs:
    """An echoed prompt's tokens in the completions shape, their `text_offset`s into `echoed_text` (the echo,
    from offset 0): the first token (and any without an entry) has a null logprob and null alternatives, as
    OpenAI gives them; the others' alternatives hold the token itself too, as a generated token's do."""
    result = CompletionLogprobs()
    tokens = [namer(token_id) for token_id in prompt_token_ids]
    result.text_offset = echoed_text_offsets(tokens, [t in namer.special_ids for t in prompt_token_ids],
                                             echoed_text)
    for token, entry in zip(tokens, entries):
        result.tokens.append(token)
        top = None
        if entry is not None:
            top = top_by_name(entry.top, namer, num_top)
            top.setdefault(token, entry.logprob)
        result.token_logprobs.append(None if entry is None else entry.logprob)
        result.top_logprobs.append(top)
    return result


def echoed_text_offsets(tokens: list[str], special: list[bool], echoed_text: str) -> list[int]:
    """Where each prompt token starts in the echoed text.

    A text prompt is echoed as the client wrote it, so what the tokenizer added to it (a BOS) is not there:
    a special token that is not at its place in the text takes no room. Token ids are echoed decoded,
    special tokens included, and one the client wrote ("<s>" in a text prompt) is in the text: those
    have their width."""
    offsets, cursor = [], 0
    for token, is_special in zip(tokens, special):
        offsets.append(cursor)
        added_by_the_tokenizer = is_special and not echoed_text.startswith(token, cursor)
        if not added_by_the_tokenizer:
            cursor += len(token)
    return offsets


def vllm_prompt_logprobs(entries: list[PromptTokenLogprob | None], namer: TokenNamer,
                         num_top: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null) its own logprob and rank and its `num_top`
    likeliest alternatives (ranks 1..num_top), keyed by token id."""
    result: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        position = {str(entry.token_id): PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                       decoded_token=namer(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(list(entry.top.items())[:num_top], start=1):
            position.setdefault(str(token_id), PromptLogprob(logprob=logprob, rank=rank, decoded_token=namer(token_id)))
        result.append(position)
    return result


def chat_logprobs(entries: list[TokenLogprob], namer: TokenNamer) -> ChatLogprobs:
    content = []
    for entry in map(json_safe, entries):
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
