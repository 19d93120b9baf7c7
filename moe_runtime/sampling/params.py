"""Per-request sampling parameters: a plain record, checked once, at admission (errors name the parameter).

Constructing one checks nothing: `__post_init__` only normalizes (a single stop string becomes a list,
None an empty list or mapping, a top_k above any vocabulary `MAX_TOP_K`), and never raises. The one
check is `validate`, called by the admission check (`RequestLimits.check`), once per request, for the
offline API and the server alike; the ranks receive admitted parameters over the control plane (msgspec
runs `__post_init__` on decoding: the normalization, idempotent) and trust them. So a bad value an
offline caller passes is refused by `LLM.generate` (at admission), naming the field, before any work.

The bounds themselves are `moe_runtime.sampling.bounds.BOUNDS`, the table the server's schema reads
too. A request `validate` accepts must never fail a worker rank: integers stay in int64, floats are
finite (NaN compares false with every bound, so each check is written to refuse it), a temperature
below `MIN_TEMPERATURE` samples greedily, structured_output is a `StructuredOutputSpec` (shape checked
by the spec itself; whether xgrammar can read it is `RequestLimits`' check, `StructuredOutputValidator`).
Checks that need the model (token ids inside the vocabulary, a tokenizer) are in `RequestLimits`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from moe_runtime.errors import InvalidRequestError
from moe_runtime.moe.routed_experts import RoutedExpertsArray
from moe_runtime.sampling import bounds
from moe_runtime.sampling.bounds import BOUND, is_int
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec

ENGINE_FIELDS = tuple(dict.fromkeys(bound.field for bound in bounds.BOUNDS if bound.engine))   # validate's fields


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
    cache_salt: str | None = None     # vLLM's: a prefix-cache partition; blocks are shared only under the same salt
    # routing replay (moe/routed_experts.py): return each position's logical expert ids (RequestOutput.
    # routed_experts, [prompt + generated - 1, moe_layers, top_k]); force those of the first positions (an array
    # of the same form; a numpy array or tensor is taken as one), weighted by the model's own gating
    return_routed_experts: bool = False
    forced_routed_experts: RoutedExpertsArray | None = None

    # the table's values under their old names (`bounds` states them)
    SEED_LIMIT: ClassVar[int] = bounds.SEED_LIMIT
    MAX_INT: ClassVar[int] = bounds.MAX_INT
    MAX_TOP_K: ClassVar[int] = bounds.MAX_TOP_K
    MIN_TEMPERATURE: ClassVar[float] = bounds.MIN_TEMPERATURE
    MAX_LOGPROBS: ClassVar[int] = BOUND["logprobs"].hi
    MAX_STOP_STRINGS: ClassVar[int] = BOUND["stop.count"].hi
    MAX_STOP_STRING_CHARS: ClassVar[int] = BOUND["stop.chars"].hi
    MAX_STOP_TOKEN_IDS: ClassVar[int] = BOUND["stop_token_ids.count"].hi
    MAX_PENALTY: ClassVar[float] = BOUND["presence_penalty"].hi
    MIN_REPETITION_PENALTY: ClassVar[float] = BOUND["repetition_penalty"].lo
    MAX_REPETITION_PENALTY: ClassVar[float] = BOUND["repetition_penalty"].hi
    MAX_LOGIT_BIAS: ClassVar[float] = BOUND["logit_bias.bias"].hi
    MAX_LOGIT_BIAS_ENTRIES: ClassVar[int] = BOUND["logit_bias.count"].hi
    MAX_CACHE_SALT_CHARS: ClassVar[int] = 1024

    def __post_init__(self) -> None:
        """Normalize, never check (see the module's docstring): a value of the wrong type is left as it is,
        for `validate` to refuse naming the field."""
        if self.stop is None or isinstance(self.stop, str):
            self.stop = [] if self.stop is None else [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is None:
            self.logit_bias = {}
        elif isinstance(self.logit_bias, Mapping) and not isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if self.forced_routed_experts is not None and not isinstance(self.forced_routed_experts, RoutedExpertsArray):
            try:
                self.forced_routed_experts = RoutedExpertsArray.of(self.forced_routed_experts)
            except (TypeError, ValueError):
                pass   # validate names it
        if is_int(self.top_k) and self.top_k > self.MAX_TOP_K:
            self.top_k = self.MAX_TOP_K  # the same meaning (every token), small enough for torch and any wire

    def validate(self) -> None:
        """The request's one check (called at admission by `RequestLimits.check`): every field inside the
        bounds table, and the rules that relate two fields. Raises `InvalidRequestError` naming the field."""
        for name in ENGINE_FIELDS:
            why = bounds.refusal(name, getattr(self, name))
            if why is not None:
                raise self._bad(name, why)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise self._bad("max_tokens", "0 generates nothing: it needs prompt_logprobs (to score the prompt)")
        if self.min_tokens > self.max_tokens:
            raise self._bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            raise self._bad("structured_output", "must be a StructuredOutputSpec (or None)")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and 0 < len(self.cache_salt) <= self.MAX_CACHE_SALT_CHARS):
            raise self._bad("cache_salt", f"must be a non-empty string of at most {self.MAX_CACHE_SALT_CHARS} "
                                          "characters (or None)")
        if not isinstance(self.return_routed_experts, bool):
            raise self._bad("return_routed_experts", "must be true or false")
        if self.forced_routed_experts is not None and not isinstance(self.forced_routed_experts, RoutedExpertsArray):
            raise self._bad("forced_routed_experts", "must be an integer array [tokens, moe_layers, top_k] (or None)")

    def _bad(self, name: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"SamplingParams.{name}={_shown(getattr(self, name))}: {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature < self.MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Any of the repetition, frequency or presence penalties set."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _shown(value: object, limit: int = 80) -> str:
    """`repr(value)`, shortened: an error message must not echo a megabyte of stop strings back. An integer
    of more than 4,300 digits has no repr (Python refuses to convert it): the message says so instead."""
    try:
        text = repr(value)
    except ValueError:
        return f"<a {type(value).__name__} holding an integer too long to show>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
