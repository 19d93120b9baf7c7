"""What sampling reads of one request: the fields the sampler, the logits processors and prompt scoring use.

`records.Sequence` (a request's state inside a DP worker) is one; sampling names only these fields, so it sits
below the records that hold a request's whole state.
"""
from __future__ import annotations

from typing import Protocol

from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.structured_output.grammar_state import GrammarState


class SamplingRow(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_seed: int                   # keys its random draws
    grammar: GrammarState | None         # structured output: where the output is in its grammar
    num_cached_tokens: int
    prompt_logprobs_done: bool           # its prompt was scored once (a preempted request's recompute skips it)

    @property
    def num_tokens(self) -> int: ...
