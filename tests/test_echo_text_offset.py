"""`text_offset` with `echo`: each offset indexes the text the response returns, whole or streamed.

The tiny tokenizer adds a BOS (`<|bos|>`) to a text prompt; the echo shows the prompt as the client wrote
it, without that BOS, so the BOS takes no room there and the prompt's first real token starts at 0. A prompt
given as token ids echoes their decoded text, BOS included: there the BOS has its width.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from server_harness import FakeEngine, serve_in_process
from transformers import AutoTokenizer

from moe_runtime.sampling.logprobs import TokenLogprob

pytestmark = pytest.mark.timeout(60)

PROMPT = "The quick brown fox"
MAX_TOKENS = 3


class TokenizingFakeEngine(FakeEngine):
    """The fake's token stream, with a real tokenizer's text and a logprob per generated token."""

    def __init__(self, tokenizer):
        super().__init__(vocab_size=len(tokenizer))
        self.tokenizer = tokenizer

    def step(self):
        return [dataclasses.replace(output, text=self.tokenizer.decode(output.token_ids),
                                    new_text=self.tokenizer.decode(output.new_token_ids),
                                    new_logprobs=[TokenLogprob(t, -1.0, {t: -1.0}) for t in output.new_token_ids])
                for output in super().step()]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def echo(tokenizer, prompt, stream: bool) -> tuple[str, list[str], list[int]]:
    """(text, tokens, text_offset) of one echoed completion with logprobs, the chunks joined when streamed."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "echo": True, "logprobs": 1, "stream": stream}

    async def scenario(client, _):
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if not stream:
            choice = response.json()["choices"][0]
            return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        text, tokens, offsets = "", [], []
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: "):])["choices"][0]
                text += choice["text"]
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
        return text, tokens, offsets

    return serve_in_process(TokenizingFakeEngine(tokenizer), scenario)


def assert_offsets_index(text: str, tokens: list[str], offsets: list[int], zero_width: set[int]) -> None:
    """Token i starts at offsets[i] in `text`; the tokens at `zero_width` are not in it (they take no room)."""
    assert len(tokens) == len(offsets)
    pieces = []
    for i, (token, offset) in enumerate(zip(tokens, offsets)):
        if i in zero_width:
            assert offset == (offsets[i + 1] if i + 1 < len(offsets) else len(text)), (i, token, offset)
            continue
        assert text[offset:offset + len(token)] == token, (i, token, offset, text)
        pieces.append(token)
    assert "".join(pieces) == text   # the offsets cover the text exactly, in order


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_prompt_offsets_leave_out_the_added_bos(tokenizer, stream):
    assert tokenizer.encode(PROMPT)[0] == tokenizer.bos_token_id
    text, tokens, offsets = echo(tokenizer, PROMPT, stream)
    assert text.startswith(PROMPT) and tokenizer.bos_token not in text
    assert tokens[0] == tokenizer.bos_token and len(tokens) == len(tokenizer.encode(PROMPT)) + MAX_TOKENS
    assert offsets[:2] == [0, 0]
    assert_offsets_index(text, tokens, offsets, zero_width={0})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_token_prompt_echoes_its_bos_and_counts_it(tokenizer, stream):
    prompt_ids = tokenizer.encode(PROMPT)
    text, tokens, offsets = echo(tokenizer, prompt_ids, stream)
    assert text.startswith(tokenizer.bos_token + PROMPT)
    assert offsets[:2] == [0, len(tokenizer.bos_token)]
    assert_offsets_index(text, tokens, offsets, zero_width=set())
