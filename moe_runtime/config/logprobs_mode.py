"""What a sampled token's logprobs are (`--logprobs-mode`, vLLM's `logprobs_mode` with the same four names).

- `raw_logprobs` (the default): log-softmax of the model's logits, before any processor: the model's own
  distribution, what OpenAI's API reports.
- `processed_logprobs`: log-softmax of the logits the token was chosen from: after structured output,
  min_tokens, logit_bias and the penalties, then, for a sampled (not greedy) request, temperature, min-p,
  top-k and top-p (tokens they drop: -inf). The sampled token's value is the log of the probability it was
  drawn with, which is what an RL trainer's policy ratio needs (its old-policy logprob).
- `raw_logits`, `processed_logits`: the same two points, before the log-softmax.

The sampled token's value and its top alternatives come from the chosen one. Prompt logprobs are always the
model's (`raw_logprobs`): nothing is sampled there.
"""
from __future__ import annotations

from enum import Enum

from moe_runtime.errors import InvalidRequestError


class LogprobsMode(str, Enum):
    RAW_LOGPROBS = "raw_logprobs"
    PROCESSED_LOGPROBS = "processed_logprobs"
    RAW_LOGITS = "raw_logits"
    PROCESSED_LOGITS = "processed_logits"

    @property
    def processed(self) -> bool:
        """Read after the logits processors and the sampling transforms (else the model's raw logits)."""
        return self in (LogprobsMode.PROCESSED_LOGPROBS, LogprobsMode.PROCESSED_LOGITS)

    @property
    def normalized(self) -> bool:
        """Log-softmax values (else the logits themselves)."""
        return self in (LogprobsMode.RAW_LOGPROBS, LogprobsMode.PROCESSED_LOGPROBS)

    @classmethod
    def parse(cls, value: "str | LogprobsMode") -> "LogprobsMode":
        """The mode named `value`; anything else is refused naming the option and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise InvalidRequestError(f"logprobs_mode={value!r} (--logprobs-mode): choose one of "
                                      f"{', '.join(mode.value for mode in cls)}") from None


LOGPROBS_MODES = tuple(mode.value for mode in LogprobsMode)
