"""One request's state inside a DP worker: tokens, KV blocks, sampling state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from moe_runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"     # the engine (or the front) could not advance this request alone


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # top-N alternatives: token id -> logprob


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int                                   # admission order, for FCFS and preemption choice
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0                     # tokens whose K/V are in the cache
    num_preemptions: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def tokens_to_compute(self) -> int:
        """New tokens the next forward must process (the whole uncached suffix)."""
        return self.num_tokens - self.num_cached_tokens
