"""What the engine returns for a request."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.moe.routed_experts import RoutedExpertsArray
from moe_runtime.sampling.logprobs import PromptLogprobs, PromptTokenLogprob, TokenLogprob


@dataclass
class KVExportInfo:
    """A prefill instance parked the request's KV blocks after sampling its first token: what a handle needs
    from the ranks (the front knows the rest: prompt, token, where the shards are)."""

    num_tokens: int                            # tokens whose KV is parked (the prompt)
    drafts: list[int] = field(default_factory=list)   # a model drafter's after the first token (filled after the
                                                      # step's drafting, `PrefillExports.note_drafts`)


@dataclass
class TokenDelta:
    """What one step added to one request: all a rank reports (O(1) bytes in the output length).

    The front turns these into `RequestOutput`s (`OutputProcessor`): text, stop strings and the
    cumulative views exist only there.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None   # one per new token when the request asked for logprobs
    finish_reason: str | None = None          # "length" | "stop" (EOS / stop token) | "error"; None = running
    error: str | None = None                  # why the engine failed this request (finish_reason "error")
    num_preemptions: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # in the request's first delta only, when it asked for them
    kv_export: KVExportInfo | None = None     # prefill instance: its blocks are parked for a decode instance
    queue_seconds: float | None = None        # arrival on the ranks to its first scheduled step (once, when known)
    cached_prompt_tokens: int | None = None   # prompt tokens the prefix cache held, in its first delta (usage's
                                              # cached_tokens)
    routed_experts: RoutedExpertsArray | None = None  # return_routed_experts: rows final since its last delta


@dataclass
class RequestOutput:
    """A request's state after one step, as the front hands it to callers.

    The cumulative fields (`token_ids`, `text`, `logprobs`) are the request's live lists: read them,
    copy them to keep a snapshot. The `new_*` fields are what this output adds to the previous one
    (`new_text` is text safe to stream: it is never taken back).
    """

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
    new_logprobs: list[TokenLogprob] | None = None           # logprobs of new_token_ids
    new_text: str = ""                                       # text added since the previous output
    sampled_at: float | None = None           # wall clock when the engine had sampled this output's tokens
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None  # one per prompt token (the first: None),
                                                                    # when the request asked for prompt_logprobs
    kv_handle: KVHandle | None = None         # prefill instance: where its parked KV blocks are, for a decode one
    cached_prompt_tokens: int = 0             # prompt tokens served from the prefix cache (OpenAI's cached_tokens)
    stop_string: str | None = None            # the stop string that ended it (finish_reason "stop"), if one did
    # return_routed_experts: [prompt + generated - 1, moe_layers, top_k] logical expert ids (the last token was
    # never fed through the model), in the finished output only (moe/routed_experts.py)
    routed_experts: np.ndarray | None = None
