"""A prompt too long for the model is refused before it is tokenized in full.

Red team round 3: a 3.9 MB prompt got its 400 ("prompt has 1950002 tokens") only after 27-34 s of the
tokenizer, holding about 0.65 GB of the front's memory per concurrent request. Two bounds now come first:

- characters: no token covers more characters than the longest token of the vocabulary (its text: bytes
  for byte-level BPE, `▁`-words for SentencePiece, an added token's whole text), so a text of more than
  `max_model_len x longest token` characters cannot fit in `max_model_len` tokens. Refused in microseconds.
- counted tokens: a text that is long for its token budget (more than `COUNT_ABOVE_CHARS_PER_TOKEN`
  characters per token of `max_model_len`) is counted in pieces (twice `max_model_len` characters, within
  [`MIN_PIECE_CHARS`, `MAX_PIECE_CHARS`]) cut at whitespace, and refused as soon as the count passes the budget: the tokenizer's work on a too-long
  prompt is bounded by `max_model_len`, not by the prompt. Cutting can change the tokens next to a cut, so
  each piece is granted `PIECE_MARGIN_TOKENS` of slack: the refusal never hits a prompt that fits.

A text that passes is tokenized whole, as before (the exact count is `check_context`'s).
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.server.errors import bad_request

COUNT_ABOVE_CHARS_PER_TOKEN = 8    # text longer than this x max_model_len is counted in pieces first
MIN_PIECE_CHARS, MAX_PIECE_CHARS = 1024, 16 * 1024   # the pieces' length (cut at a whitespace before it, if any)
PIECE_MARGIN_TOKENS = 8            # tokens a cut may add or remove, granted per piece
CODE = "context_length_exceeded"


@dataclass(frozen=True)
class PromptSizeBound:
    """What a prompt's text may hold for a model of `max_model_len` tokens whose longest token has
    `longest_token_chars` characters."""

    max_model_len: int
    longest_token_chars: int

    @classmethod
    def of(cls, tokenizer, max_model_len: int) -> "PromptSizeBound | None":
        """The bound of a transformers tokenizer (None for one that lists no vocabulary: no bound)."""
        vocabulary = getattr(tokenizer, "get_vocab", None)
        if vocabulary is None:
            return None
        longest = max((len(token) for token in vocabulary()), default=1)
        return cls(max_model_len, max(longest, 1))

    @property
    def piece_chars(self) -> int:
        return min(max(2 * self.max_model_len, MIN_PIECE_CHARS), MAX_PIECE_CHARS)

    @property
    def char_limit(self) -> int:
        return self.max_model_len * self.longest_token_chars

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.char_limit:
            raise bad_request(f"{param} has {chars:,} characters, more than {self.max_model_len:,} tokens can hold "
                              f"(the longest token has {self.longest_token_chars} characters: at most "
                              f"{self.char_limit:,}); shorten it", param, CODE)

    def encode(self, tokenizer, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """`tokenizer.encode(text)`, after the two bounds above."""
        self.check_chars(len(text), param)
        if len(text) > COUNT_ABOVE_CHARS_PER_TOKEN * self.max_model_len:
            self._count_in_pieces(tokenizer, text, param)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _count_in_pieces(self, tokenizer, text: str, param: str) -> None:
        counted, start, pieces = 0, 0, 0
        while start < len(text):
            end = piece_end(text, start, self.piece_chars)
            counted += len(tokenizer.encode(text[start:end], add_special_tokens=False))
            pieces += 1
            if counted > self.max_model_len + PIECE_MARGIN_TOKENS * pieces:
                raise bad_request(f"{param} has more than {self.max_model_len:,} tokens ({counted:,} in its first "
                                  f"{end:,} of {len(text):,} characters); shorten it", param, CODE)
            start = end


def piece_end(text: str, start: int, piece_chars: int) -> int:
    """Where the piece from `start` ends: `piece_chars` on, moved back to just before a whitespace (within the
    piece's second half; else cut where it is)."""
    end = start + piece_chars
    if end >= len(text):
        return len(text)
    half = start + piece_chars // 2
    cut = max(text.rfind(" ", half, end), text.rfind("\n", half, end))
    return cut if cut > start else end
