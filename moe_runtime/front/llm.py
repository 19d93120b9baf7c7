"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import logging
from dataclasses import fields

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.errors import InvalidRequestError
from moe_runtime.engine.outputs import RequestOutput
from moe_runtime.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """An engine on a checkpoint directory. Use as a context manager or call `shutdown()`."""

    def __init__(self, model: str, **kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {unknown}; known: {sorted(known - {'model'})}")
        self.config = EngineConfig(model=str(model), **kwargs)
        self._engine = make_engine(self.config)
        self._request_ids = itertools.count()

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def engine(self):
        return self._engine

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self._engine.tokenizer is None:
                raise InvalidRequestError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
            return self._engine.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of `prompts`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        request_ids = []
        for prompt, p in zip(prompts, params_list):
            request_id = f"offline-{next(self._request_ids)}"
            self._engine.add_request(request_id, self._token_ids(prompt), p)
            request_ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            for output in self._engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[r] for r in request_ids]

    def expert_load(self):
        """The expert-load snapshot summed over ranks (`load_balancer.ExpertLoadSnapshot`: counts [L, E] over
        the window, totals, per-rank load [L, W], balancedness [L], placement), or None for a dense model."""
        return self._engine.wait(self._engine.expert_load())

    def rebalance_now(self, fail_on_rank: int | None = None):
        """Plan a placement from the recorded window and migrate expert weights now; a RebalanceEvent.
        `fail_on_rank` injects a migration failure on that rank (fault-injection tests): the event then
        reports ok=False and the previous placement stays in force."""
        return self._engine.wait(self._engine.rebalance_now(fail_on_rank))

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
