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
    finish_reason: str | None = None          # "length" | "stop" | "abort"
    logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the step that produced this
