"""What the engine returns for a request."""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.sequence import TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                      # generated tokens so far (all of them)
    text: str                                 # detokenized output so far (cut at a stop string)
    finished: bool
    finish_reason: str | None = None          # "length" | "stop" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the step that produced this
    error: str | None = None                  # why the engine failed this request (finish_reason "error")


def error_message(exc: BaseException, limit: int = 200) -> str:
    """A short, one-line description of `exc` for `RequestOutput.error` (clients see it)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
