"""xgrammar's view of a tokenizer: every token's bytes, the stop tokens, the special tokens. Built once per engine.

Two corrections to `TokenizerInfo.from_huggingface`, which this starts from (it detects the vocabulary's
encoding, byte-level or SentencePiece, and the prefix-space rule):

- special tokens (BOS, padding, chat markers) are given no text, which xgrammar reads as "special:
  never allowed". Otherwise a grammar could accept `<|im_start|>` as seven literal characters inside
  a JSON string, and the detokenizer (which skips special tokens) would drop them from the text;
- the stop tokens are the engine's (EOS ids from generation_config.json), not only the tokenizer's
  eos_token: a grammar that is complete allows exactly the tokens that end the request.

The mask covers the model's vocabulary (the LM head's rows), which may be larger than the tokenizer's
(padding rows, never allowed) or smaller (tokens the model cannot emit, left out).
"""
from __future__ import annotations

from typing import Iterable

import xgrammar


def special_token_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: the named ones (bos/eos/pad/...) and added tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def build_tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> xgrammar.TokenizerInfo:
    """`vocab_size`: the model's (the logits' last dimension); `stop_token_ids`: what ends a request (EOS)."""
    stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
    if not stops and getattr(tokenizer, "eos_token_id", None) is not None:
        stops = [int(tokenizer.eos_token_id)]
    detected = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stops or None)
    encoded: list[str] = [""] * vocab_size                  # "" = no text: special, never allowed
    for token, token_id in tokenizer.get_vocab().items():
        if 0 <= token_id < vocab_size:
            encoded[token_id] = token
    for token_id in special_token_ids(tokenizer) | set(stops):   # stop tokens end the output, by id only
        if 0 <= token_id < vocab_size:
            encoded[token_id] = ""
    return xgrammar.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                                  stop_token_ids=stops or list(detected.stop_token_ids),
                                  add_prefix_space=detected.add_prefix_space)
