"""Per-request sampling parameters, validated up front (errors name the parameter).

`validate` is the one place that decides what the engine can do; the server's schema, the offline
API and every engine rely on it. A request it accepts must never fail a worker rank:

- integers stay in int64 (torch tensors, generator seeds, the control plane's wire format);
- floats are finite (NaN compares false with every bound, so each check is written to refuse it);
- a temperature below `MIN_TEMPERATURE` samples greedily (dividing logits by it would overflow
  float32 to inf and the probabilities to NaN);
- a top_k at or above the vocabulary keeps every token, so it is capped at `MAX_TOP_K` (larger
  than any vocabulary) and never reaches torch as a huge integer;
- stop strings and stop token ids are bounded in number and size: they are matched every step;
- penalties, min_p and logit_bias are bounded (a penalty near 0 would overflow the logits), and
  logit_bias has at most `MAX_LOGIT_BIAS_ENTRIES` entries: each is applied every step;
- structured_output is a `StructuredOutputSpec` (shape checked by the spec itself; whether xgrammar
  can read it is the front's check, `StructuredOutputValidator`, as it needs xgrammar).

Checks that need the model (token ids inside the vocabulary, a tokenizer) are in `RequestLimits`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 (or below MIN_TEMPERATURE) = greedy
    top_k: int = -1                   # -1 / 0 = off; >= the vocabulary = off too
    top_p: float = 1.0
    seed: int | None = None           # per-request generator: the same seed reproduces the same tokens
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # None = off; N = the chosen token's logprob and the top-N alternatives
    min_tokens: int = 0               # EOS and stop_token_ids are forbidden until this many tokens are out
    prompt_logprobs: int | None = None  # None = off; N = each prompt token's logprob and its top-N alternatives
                                        # (max_tokens may then be 0: score the prompt, generate nothing)

    presence_penalty: float = 0.0     # OpenAI's: minus this for every token already in the output
    frequency_penalty: float = 0.0    # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0   # transformers': a prompt or output token's logit / this (> 0) or * this (< 0)
    min_p: float = 0.0                # drop tokens below min_p x the top token's probability (after temperature)
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    structured_output: StructuredOutputSpec | None = None        # the output must match it (xgrammar)

    SEED_LIMIT: ClassVar[int] = 2**63          # seeds are in [0, SEED_LIMIT)
    MAX_INT: ClassVar[int] = 2**63 - 1         # the largest integer the engine carries (int64)
    MAX_TOP_K: ClassVar[int] = 2**31 - 1       # above any vocabulary: top_k is capped here
    MIN_TEMPERATURE: ClassVar[float] = 1e-5    # below it sampling is greedy
    MAX_LOGPROBS: ClassVar[int] = 20
    MAX_STOP_STRINGS: ClassVar[int] = 16
    MAX_STOP_STRING_CHARS: ClassVar[int] = 1024
    MAX_STOP_TOKEN_IDS: ClassVar[int] = 1024
    MAX_PENALTY: ClassVar[float] = 2.0             # presence and frequency penalties are in [-2, 2] (OpenAI's range)
    MIN_REPETITION_PENALTY: ClassVar[float] = 0.01  # repetition_penalty is in [0.01, 100]: 1 = off
    MAX_REPETITION_PENALTY: ClassVar[float] = 100.0
    MAX_LOGIT_BIAS: ClassVar[float] = 100.0        # a bias is in [-100, 100] (OpenAI's range)
    MAX_LOGIT_BIAS_ENTRIES: ClassVar[int] = 1024

    def __post_init__(self) -> None:
        self.stop = self._as_list("stop", [self.stop] if isinstance(self.stop, str) else self.stop)
        self.stop_token_ids = self._as_list("stop_token_ids", self.stop_token_ids)
        self.logit_bias = self._as_dict("logit_bias", self.logit_bias)
        if is_int(self.top_k) and self.top_k > self.MAX_TOP_K:
            self.top_k = self.MAX_TOP_K  # the same meaning (every token), small enough for torch and any wire
        self.validate()

    def _as_list(self, name: str, value: object) -> list:
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            raise InvalidRequestError(f"SamplingParams.{name}={_shown(value)}: must be a list")
        return list(value)

    def _as_dict(self, name: str, value: object) -> dict:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise InvalidRequestError(f"SamplingParams.{name}={_shown(value)}: must be a mapping")
        return dict(value)

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={_shown(getattr(self, name))}: {why}")

        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer between 0 and {self.MAX_LOGPROBS}")
        fewest = 0 if self.prompt_logprobs is not None else 1   # 0 with prompt_logprobs: score the prompt only
        if not is_int(self.max_tokens) or not fewest <= self.max_tokens <= self.MAX_INT:
            raise bad("max_tokens", f"must be an integer in [{fewest}, {self.MAX_INT}] (0 only with prompt_logprobs)")
        if not is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", f"must be a finite number >= 0 (below {self.MIN_TEMPERATURE} samples greedily)")
        if not is_int(self.top_k) or not -1 <= self.top_k <= self.MAX_TOP_K:
            raise bad("top_k", f"must be -1 (off) or an integer in [0, {self.MAX_TOP_K}] (0 and values >= the "
                               f"vocabulary: off)")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < self.SEED_LIMIT):
            raise bad("seed", f"must be an integer in [0, 2**63) (at most {self.SEED_LIMIT - 1})")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer between 0 and {self.MAX_LOGPROBS}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer between 0 and max_tokens")
        self._validate_stops(bad)
        self._validate_logit_processors(bad)

    def _validate_stops(self, bad) -> None:
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise bad("stop", f"at most {self.MAX_STOP_STRINGS} stop strings (got {len(self.stop)})")
        if any(not isinstance(s, str) for s in self.stop):
            raise bad("stop", "stop strings must be strings")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(len(s) > self.MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"a stop string may have at most {self.MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {self.MAX_STOP_TOKEN_IDS} stop token ids "
                                        f"(got {len(self.stop_token_ids)})")
        if any(not is_int(t) or not 0 <= t <= self.MAX_INT for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids (integers >= 0)")

    def _validate_logit_processors(self, bad) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -self.MAX_PENALTY <= value <= self.MAX_PENALTY:
                raise bad(name, f"must be a number in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}] (0 = off)")
        low, high = self.MIN_REPETITION_PENALTY, self.MAX_REPETITION_PENALTY
        if not is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be a number in [{low:g}, {high:g}] (1 = off)")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1] (0 = off)")
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must be a mapping of token ids to biases")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS_ENTRIES:
            raise bad("logit_bias", f"at most {self.MAX_LOGIT_BIAS_ENTRIES} entries (got {len(self.logit_bias)})")
        if any(not is_int(t) or not 0 <= t <= self.MAX_INT for t in self.logit_bias):
            raise bad("logit_bias", "keys must be token ids (integers >= 0)")
        if any(not is_number(b) or not -self.MAX_LOGIT_BIAS <= b <= self.MAX_LOGIT_BIAS
               for b in self.logit_bias.values()):
            raise bad("logit_bias", f"biases must be numbers in [-{self.MAX_LOGIT_BIAS:g}, {self.MAX_LOGIT_BIAS:g}]")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            raise bad("structured_output", "must be a StructuredOutputSpec (or None)")

    @property
    def greedy(self) -> bool:
        return self.temperature < self.MIN_TEMPERATURE


def _shown(value: object, limit: int = 80) -> str:
    """`repr(value)`, shortened: an error message must not echo a megabyte of stop strings back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
