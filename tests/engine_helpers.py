"""Small helpers the engine tests share: prompts of several lengths and direct prefill logits."""
from __future__ import annotations

import torch

from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.params import SamplingParams

PROMPTS = [
    [5, 17, 42, 99, 3],
    [7, 8, 9, 10, 11, 12, 13, 200, 300, 1, 2, 33, 44, 55, 66, 77, 88, 99, 111, 122],
    [77],
    [400, 12, 12, 12, 250, 31, 64, 128, 9],
]


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def runtime_prefill_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, V] of every prompt position, through the engine core's own runner and KV cache
    (`engine`: an `EngineCore`, e.g. `LLM(...).core`)."""
    seq = Sequence("prefill-logits", list(token_ids), greedy(1), arrival=-1)
    engine.block_manager.allocate(seq)
    seq.num_scheduled_tokens = len(token_ids)
    try:
        inputs = engine.runner.prepare([seq])
        with torch.inference_mode():
            hidden = engine.model(inputs.input_ids, inputs.positions, inputs.batch, engine.runner.caches)
            return engine.model.logits(hidden)
    finally:
        engine.block_manager.free(seq)
