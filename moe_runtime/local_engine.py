"""One rank in this process, behind the front's face: the `Engine` that `LLM` and `moe-serve` drive
when the layout has a single rank.

The core (`EngineCore`) samples token ids; this front admits requests (the one `RequestLimits`
check) and turns the core's deltas into outputs (`OutputProcessor`: text, stop strings), exactly
as `MultiprocessEngine` does for ranks in other processes.
"""
from __future__ import annotations

import time

from load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.engine_config import EngineConfig
from moe_runtime.engine_core import EngineCore
from moe_runtime.engine_protocol import EngineHealth, EngineStats
from moe_runtime.errors import InvalidRequestError
from moe_runtime.output_processor import OutputProcessor
from moe_runtime.outputs import RequestOutput
from moe_runtime.request_limits import RequestLimits
from moe_runtime.sampling_params import SamplingParams


class LocalEngine:
    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.limits: RequestLimits = self.core.limits()
        self.outputs = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.outputs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.limits.check(prompt_token_ids, params)
        prompt = list(prompt_token_ids)
        self.core.add_request(request_id, prompt, params)
        self.outputs.add(request_id, prompt, params)

    def abort(self, request_id: str) -> bool:
        self.core.abort(request_id)
        return self.outputs.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        deltas = self.core.step()
        sampled_at = time.time()
        processed = self.outputs.process(deltas)
        for request_id, reason in processed.ended.items():
            self.core.abort(request_id, reason)
        for output in processed.outputs:
            output.sampled_at = sampled_at
        return processed.outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def health(self) -> EngineHealth:
        return self.core.health()

    def expert_load(self):
        return self.core.expert_load()

    def rebalance_now(self) -> RebalanceEvent:
        return self.core.rebalance_now()

    def rebalance_events(self) -> list[RebalanceEvent]:
        return self.core.rebalance_events()

    def shutdown(self) -> None:
        self.core.shutdown()
