"""What one choice of an API response sends per step: its new text, tokens and logprobs.

The engine's front already made each output's `new_text` safe to stream (held-back incomplete
UTF-8 and possible stop-string prefixes; see `moe_runtime.front.output_processor`), so a choice only
forwards what is new, with no re-diffing of cumulative text.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_runtime.sampling.logprobs import PromptTokenLogprob, TokenLogprob
from moe_runtime.records.outputs import RequestOutput


@dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None          # set on the last delta: "stop" | "length" | "abort" | "error"
    first: bool = False                # the choice's first delta (an echoed prompt leads it)
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None   # on the first delta, when asked for
    routed_experts: np.ndarray | None = None   # on the last delta, when asked for (return_routed_experts)


@dataclass
class ChoiceTracker:
    """Where one choice stands; `advance(output)` returns what the output adds."""

    finish_reason: str | None = None
    num_tokens: int = 0
    started: bool = False
    kv_handle: object | None = None    # prefill instance: its parked KV's `KVHandle`, on the last output
    cached_prompt_tokens: int = 0      # prompt tokens the prefix cache held (usage's cached_tokens)
    stop_string: str | None = None     # the stop string that ended it, if one did
    routed_experts: np.ndarray | None = None   # return_routed_experts: the finished choice's array

    def advance(self, output: RequestOutput) -> ChoiceDelta:
        self.num_tokens = len(output.token_ids)
        self.cached_prompt_tokens = max(self.cached_prompt_tokens, output.cached_prompt_tokens)
        self.stop_string = output.stop_string
        if output.finished:
            self.finish_reason = output.finish_reason
            self.kv_handle = output.kv_handle
            self.routed_experts = output.routed_experts
        first, self.started = not self.started, True
        return ChoiceDelta(output.new_text, output.new_token_ids, output.new_logprobs or [],
                           output.finish_reason if output.finished else None, first,
                           output.prompt_logprobs if first else None,
                           output.routed_experts if output.finished else None)
