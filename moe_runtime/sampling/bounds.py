"""The bounds of every request field, stated once: the HTTP schema and the engine's admission check read them here.

`BOUNDS` is the one table. The server's pydantic models take their `ge`/`le`/... constraints from it
(`Bound.schema`, so the OpenAPI schema shows them and a violation is a 400 naming the field) and check
the list/mapping fields with `refusal`; the engine's admission check (`RequestLimits.check` ->
`SamplingParams.validate`) refuses with the same `refusal`. A value one layer takes, the other takes.

Why these values:

- temperature is in [0, 2], OpenAI's documented range. OpenAI-compatible clients and tools assume it,
  the HTTP schema always refused more, and above 2 the sampled distribution is already close to uniform
  over the vocabulary: nothing useful is lost by refusing it offline too (the engine alone took any
  finite temperature before). Below `MIN_TEMPERATURE` sampling is greedy (dividing the logits by it
  would overflow float32).
- presence/frequency penalties in [-2, 2] and logit biases in [-100, 100] are OpenAI's ranges;
  repetition_penalty in [0.01, 100] (transformers' and vLLM's meaning; near 0 it would overflow the logits).
- integers stay in int64 (torch tensors, generator seeds, the control plane's wire format): max_tokens,
  min_tokens and token ids are at most `MAX_INT`, seeds are in [0, 2**63).
- top_k at or above the vocabulary keeps every token, so any larger value is taken and capped at
  `MAX_TOP_K` (above any vocabulary) before it reaches torch (`Bound.capped`).
- logprobs (chat's top_logprobs) and prompt_logprobs: at most 20 alternatives, as OpenAI's top_logprobs.
- stop strings, stop token ids and logit_bias entries are matched or applied every step: bounded in
  number (and a stop string in length; an empty one would match everywhere).
- n (choices per prompt, an HTTP field: offline callers pass one SamplingParams per choice) is in [1, 64].

Rules that relate two fields (max_tokens 0 only with prompt_logprobs, min_tokens <= max_tokens) and the
ones that need the model (token ids inside the vocabulary, a tokenizer) are not bounds: they are checked
at admission (`SamplingParams.validate`, `RequestLimits`).

`WORK_BOUNDS` bound what one HTTP request asks for in all, products of its fields: the server makes one
engine request per choice (prompts x n), each with the whole prompt and its own sampling state, and one
response holds them all. Each is checked before anything is built (`server.request_work`):
- choices (prompts x n) at most 256: a choice is an engine request, a queue slot, a stream;
- prompt tokens x n at most 2**20: each choice's prompt is admitted (checked, hashed) and may be prefilled;
- logit_bias entries x choices at most 2**16 (1,024 entries on 64 choices): they are applied at every step;
- logprob entries in the response at most 2**17: positions x (alternatives + 1) x choices over every view
  (prompt_logprobs, an echo's logprobs, the generated tokens' logprobs), about 80 bytes of JSON and 1.3 KB
  of the front's memory each (prompt_logprobs=20 on a 2,000-token prompt with n=64 made 2.7 million: a
  180 MB response after minutes); 2**17 is 20 alternatives over a 6,000-token prompt.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MAX_INT = 2**63 - 1          # the largest integer the engine carries (int64)
SEED_LIMIT = 2**63           # seeds are in [0, SEED_LIMIT)
MAX_TOP_K = 2**31 - 1        # above any vocabulary: a larger top_k is capped here
MIN_TEMPERATURE = 1e-5       # below it sampling is greedy
TOKEN_ID_DIGITS = len(str(MAX_INT))   # a token id written in decimal has at most this many digits


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(number: float) -> str:
    if number == SEED_LIMIT:
        return "2**63"
    if number == MAX_INT:
        return "2**63 - 1"
    return f"{number:g}" if isinstance(number, float) else str(number)


@dataclass(frozen=True)
class Bound:
    """One bounded quantity of a request field.

    `part` says what is bounded: "value" (the field itself), "count" (the items of a list or mapping),
    "chars" (the length of each string of a list), "item" (each element of a list), "key" / "bias" (each
    key / value of a mapping). `lo`/`hi` are inclusive unless `lo_open`/`hi_open`; None is unbounded.
    With `capped`, a value above `hi` means `hi` (top_k: every token): the schema takes it, and
    `SamplingParams` caps it when constructed (so `admits`, which sees the capped value, keeps `hi`)."""

    field: str
    part: str = "value"
    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False
    capped: bool = False
    engine: bool = True       # a SamplingParams field (False: the HTTP layer's only, as n)
    note: str = ""            # what a value means, shown in the refusal ("0 = off")

    @property
    def key(self) -> str:
        return self.field if self.part == "value" else f"{self.field}.{self.part}"

    def admits(self, value: object) -> bool:
        """Inside the bound (and of its type). Written so that NaN, which compares false, is refused."""
        if self.integer and not is_int(value):
            return False
        if not is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
            return False
        if self.lo is not None and not (value > self.lo if self.lo_open else value >= self.lo):
            return False
        if self.hi is not None and not (value < self.hi if self.hi_open else value <= self.hi):
            return False
        return True

    def describe(self) -> str:
        """"an integer in [0, 20]", "a number in (0, 1]", ..."""
        kind = "an integer" if self.integer else "a number"
        if self.lo is not None and self.hi is not None:
            opening, closing = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            text = f"{kind} in {opening}{_shown(self.lo)}, {_shown(self.hi)}{closing}"
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {_shown(self.lo)}"
        else:
            text = kind
        return f"{text} ({self.note})" if self.note else text

    def schema(self, **override) -> dict:
        """The bound as pydantic `Field` keyword arguments (ge/gt/le/lt); `override` replaces lo/hi (an
        endpoint's own stricter edge, as chat's max_tokens >= 1)."""
        lo, hi = override.get("lo", self.lo), override.get("hi", self.hi)
        if self.part == "count":
            return {} if hi is None else {"max_length": hi}
        constraints = {}
        if lo is not None:
            constraints["gt" if self.lo_open else "ge"] = lo
        if hi is not None and not self.capped:
            constraints["lt" if self.hi_open else "le"] = hi
        return constraints


BOUNDS: tuple[Bound, ...] = (
    Bound("max_tokens", lo=0, hi=MAX_INT, integer=True, note="0 only with prompt_logprobs: score the prompt"),
    Bound("min_tokens", lo=0, hi=MAX_INT, integer=True, note="at most max_tokens"),
    Bound("temperature", lo=0.0, hi=2.0, note=f"below {MIN_TEMPERATURE:g} samples greedily"),
    Bound("top_p", lo=0.0, hi=1.0, lo_open=True),
    Bound("top_k", lo=-1, hi=MAX_TOP_K, integer=True, capped=True, note="-1 or 0 = off, as is any value >= the "
                                                                        "vocabulary"),
    Bound("min_p", lo=0.0, hi=1.0, note="0 = off"),
    Bound("presence_penalty", lo=-2.0, hi=2.0, note="0 = off"),
    Bound("frequency_penalty", lo=-2.0, hi=2.0, note="0 = off"),
    Bound("repetition_penalty", lo=0.01, hi=100.0, note="1 = off"),
    Bound("seed", lo=0, hi=SEED_LIMIT, integer=True, hi_open=True),
    Bound("logprobs", lo=0, hi=20, integer=True),
    Bound("prompt_logprobs", lo=0, hi=20, integer=True),
    Bound("n", lo=1, hi=64, integer=True, engine=False),
    Bound("stop", "count", hi=16, integer=True),
    Bound("stop", "chars", lo=1, hi=1024, integer=True),
    Bound("stop_token_ids", "count", hi=1024, integer=True),
    Bound("stop_token_ids", "item", lo=0, hi=MAX_INT, integer=True),
    Bound("logit_bias", "count", hi=1024, integer=True),
    Bound("logit_bias", "key", lo=0, hi=MAX_INT, integer=True),
    Bound("logit_bias", "bias", lo=-100.0, hi=100.0),
)
BOUND: dict[str, Bound] = {bound.key: bound for bound in BOUNDS}   # "temperature", "stop.chars", ...
OPTIONAL = frozenset({"seed", "logprobs", "prompt_logprobs"})       # None = unset (off) is in bounds


def _counted(field: str, what: str, items: object) -> str | None:
    bound = BOUND[f"{field}.count"]
    if len(items) > bound.hi:
        return f"at most {bound.hi} {what} (got {len(items)})"
    return None


def refusal(field: str, value: object) -> str | None:
    """Why `value` is outside the table's bounds for request field `field` (None: inside). Both the HTTP
    schema (list and mapping fields) and the engine (every field) refuse with it. `stop` may be a string
    (the HTTP form of one stop string); logit_bias keys must be integers (the HTTP layer converts its
    string keys first)."""
    if field == "stop":
        strings = [value] if isinstance(value, str) else value
        if not isinstance(strings, (list, tuple)):
            return "must be a string or a list of strings"
        chars = BOUND["stop.chars"]
        too_many = _counted(field, "stop strings", strings)
        if too_many is not None:
            return too_many
        if any(not isinstance(s, str) for s in strings):
            return "stop strings must be strings"
        wrong = next((s for s in strings if not chars.admits(len(s))), None)
        if wrong is not None:
            return (f"a stop string must have {chars.lo} to {chars.hi} characters (got {len(wrong)}"
                    f"{': it would match everywhere' if not wrong else ''})")
        return None
    if field == "stop_token_ids":
        if not isinstance(value, (list, tuple)):
            return "must be a list of token ids"
        item = BOUND["stop_token_ids.item"]
        return (_counted(field, "stop token ids", value)
                or (f"must be token ids ({item.describe()})" if not all(map(item.admits, value)) else None))
    if field == "logit_bias":
        if not isinstance(value, Mapping):
            return "must be a mapping of token ids to biases"
        key, bias = BOUND["logit_bias.key"], BOUND["logit_bias.bias"]
        return (_counted(field, "entries", value)
                or (f"keys must be token ids ({key.describe()})" if not all(map(key.admits, value)) else None)
                or (f"biases must be {bias.describe()}" if not all(map(bias.admits, value.values())) else None))
    bound = BOUND[field]
    if value is None and field in OPTIONAL:
        return None
    return None if bound.admits(value) else f"must be {bound.describe()}"


@dataclass(frozen=True)
class WorkBound:
    """A bound on one HTTP request as a whole: `counted` (a product of its fields) is at most `hi`."""

    name: str
    hi: int
    counted: str       # what is counted, as a refusal says it

    def exceeded_by(self, amount: int) -> bool:
        return amount > self.hi


WORK_BOUNDS: tuple[WorkBound, ...] = (
    WorkBound("choices", 256, "choices (prompts x n)"),
    WorkBound("prompt_tokens", 2**20, "prompt tokens to admit (prompt tokens x n)"),
    WorkBound("logit_bias", 2**16, "logit_bias entries to apply (entries x choices)"),
    WorkBound("logprobs", 2**17, "logprobs in the response (positions x (alternatives + 1) x choices)"),
)
WORK_BOUND: dict[str, WorkBound] = {bound.name: bound for bound in WORK_BOUNDS}
