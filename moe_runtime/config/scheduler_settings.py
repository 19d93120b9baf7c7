"""The scheduler part of the engine's settings: how many sequences and tokens one step takes, whether prefills
are chunked into decode steps, and how the front routes a request among DP attention workers."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.config_error import EngineConfigError


@dataclass
class SchedulerSettings:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096   # tokens one step computes (prefill tokens of a step, chunked or not)
    enable_chunked_prefill: bool = True   # decodes and prefill chunks share each step, under that token budget
    cache_aware_routing: bool = True      # with prefix caching and dp_attn > 1: route to where a prefix is cached

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise EngineConfigError(f"--max-num-seqs {self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise EngineConfigError(f"--max-num-batched-tokens {self.max_num_batched_tokens}: must be >= 1")
