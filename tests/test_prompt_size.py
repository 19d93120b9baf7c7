"""A prompt too long for the model is refused before it is tokenized in full (moe_runtime/server/prompt_size.py), and a
prompt that fits is never refused by the early bounds: its ids are the tokenizer's own."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from moe_runtime.server.errors import APIError
from moe_runtime.server.prompt_size import COUNT_ABOVE_CHARS_PER_TOKEN, PromptSizeBound

MAX_MODEL_LEN = 256


class CountingTokenizer:
    """A real tokenizer that records how many characters it was asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded_chars = tokenizer, 0

    def get_vocab(self):
        return self.tokenizer.get_vocab()

    def encode(self, text, add_special_tokens=True):
        self.encoded_chars += len(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return CountingTokenizer(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))


def test_more_characters_than_any_tokenization_can_hold_is_refused_without_the_tokenizer(tokenizer):
    bound = PromptSizeBound.of(tokenizer, MAX_MODEL_LEN)
    assert bound.longest_token_chars == max(len(t) for t in tokenizer.get_vocab())
    before = tokenizer.encoded_chars
    with pytest.raises(APIError) as refused:
        bound.encode(tokenizer, "a " * 1_950_000, "prompt")   # red team round 3's prompt
    assert refused.value.param == "prompt" and refused.value.code == "context_length_exceeded"
    assert "3,900,000 characters" in refused.value.message
    assert tokenizer.encoded_chars == before


def test_a_long_text_under_the_character_bound_is_counted_in_pieces_and_refused_early(tokenizer):
    bound = PromptSizeBound.of(tokenizer, MAX_MODEL_LEN)
    words = " ".join(f"w{i % 97}x{i % 13}" for i in range(bound.char_limit // 8))   # many tokens per character
    assert COUNT_ABOVE_CHARS_PER_TOKEN * MAX_MODEL_LEN < len(words) <= bound.char_limit
    before = tokenizer.encoded_chars
    with pytest.raises(APIError, match="more than 256 tokens") as refused:
        bound.encode(tokenizer, words, "messages")
    assert refused.value.param == "messages"
    assert tokenizer.encoded_chars - before < len(words) / 2   # stopped well before the end


@pytest.mark.parametrize("kind", ["spaces", "one_word", "lines", "unicode", "mixed"])
def test_a_prompt_that_fits_gets_exactly_the_tokenizers_ids(tokenizer, kind):
    """Texts long in characters but within max_model_len tokens (the pieces' count must not refuse them), and
    texts just over the budget (refused, as the exact count would)."""
    rng = random.Random(kind)
    alphabet = {"spaces": " ", "one_word": "a", "lines": "ab\n", "unicode": "éß中🙂 ", "mixed": "abc xyz\n\t.,"}[kind]
    bound = PromptSizeBound.of(tokenizer, MAX_MODEL_LEN)
    for length in (10, 1_000, 3 * COUNT_ABOVE_CHARS_PER_TOKEN * MAX_MODEL_LEN):
        text = "".join(rng.choice(alphabet) for _ in range(length))
        if len(text) > bound.char_limit:
            continue
        exact = tokenizer.tokenizer.encode(text)
        try:
            assert bound.encode(tokenizer, text, "prompt") == exact
        except APIError:
            assert len(exact) > MAX_MODEL_LEN, (kind, length, len(exact))   # refused only when it does not fit


@pytest.mark.parametrize("kind", ["spaces", "one_word", "lines", "unicode", "mixed", "words"])
def test_a_prompt_exactly_at_the_budget_passes_the_pieces_count(tokenizer, kind, monkeypatch):
    """The pieces' count with every text counted (threshold 1 character per token) in pieces of 1,024 characters
    and the budget set to the text's exact token count: cuts must never push a prompt that fits over it."""
    from moe_runtime.server import prompt_size

    monkeypatch.setattr(prompt_size, "COUNT_ABOVE_CHARS_PER_TOKEN", 1)
    monkeypatch.setattr(prompt_size, "MAX_PIECE_CHARS", 1024)   # many cuts
    rng = random.Random(kind)
    alphabet = {"spaces": " ", "one_word": "a", "lines": "ab\n", "unicode": "éß中🙂 ", "mixed": "abc xyz\n\t.,",
                "words": ["the ", "cat ", "sat\n", "on ", "mat. ", "  "]}[kind]
    longest = PromptSizeBound.of(tokenizer, 1).longest_token_chars
    for length in (3_000, 20_000):
        text = "".join(rng.choice(alphabet) for _ in range(length))
        exact = tokenizer.tokenizer.encode(text)
        bound = PromptSizeBound(len(exact), longest)
        assert len(text) > bound.piece_chars and len(text) <= bound.char_limit
        before = tokenizer.encoded_chars
        assert bound.encode(tokenizer, text, "prompt") == exact
        if len(text) > len(exact):   # fewer tokens than characters: counted in pieces, then encoded whole
            assert tokenizer.encoded_chars - before >= 2 * len(text)
