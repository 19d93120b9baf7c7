"""What the context-parallel tests run on each rank of the gloo pool: one engine core per rank, built for a
layout, generating greedily in lock-step (every rank of a DP worker schedules the same steps)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_runtime.processes.distributed import build_parallel_context
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.sampling.params import SamplingParams


@dataclass
class RankRun:
    tokens: list[list[int]]        # greedy tokens of each prompt
    exchanges: int                 # K/V all-gathers this rank joined (0 without context parallelism)
    bytes_received: int
    first_prompt_logprobs: list[float]   # logprob of each token 1..P-1 of the first prompt given those before it
    prefix_cache_hits: int               # prompt tokens found in the prefix cache


def generate_on_rank(path: str, prompts: list[list[int]], max_new_tokens: int, **config) -> RankRun:
    """Greedy tokens of `prompts` from an engine core of this rank in layout `config` (EngineConfig fields)."""
    engine_config = EngineConfig(model=path, device="cpu", dtype="float32", **config)
    parallel = build_parallel_context(engine_config.layout(), dist.get_rank(), torch.device("cpu"),
                                      load_hf_config(path).num_hidden_layers)
    core = EngineCore(engine_config, parallel)
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=0 if index == 0 else None)
        core.add_request(str(index), list(prompt), params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    scored: list[float] = []
    while _anyone_busy(core.has_unfinished()):
        for delta in core.step() if core.has_unfinished() else core.execute(None):
            tokens[delta.request_id].extend(delta.new_token_ids)
            if delta.prompt_logprobs is not None:
                scored = delta.prompt_logprobs.logprobs
    cp = core.model.context_parallel
    run = RankRun([tokens[str(i)] for i in range(len(prompts))], cp.stats.exchanges if cp else 0,
                  cp.stats.bytes_received if cp else 0, scored, core.block_manager.counters.hits)
    core.shutdown()
    return run


def _anyone_busy(busy: bool) -> bool:
    """Whether any rank has work (DP workers of one job step together, an idle one with an empty batch)."""
    flag = torch.tensor([int(busy)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
