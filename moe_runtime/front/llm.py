"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import logging
from dataclasses import fields

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.front.front import Front
from moe_runtime.errors import InvalidRequestError
from moe_runtime.records.outputs import RequestOutput
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.engine.weight_update_group import JOIN_TIMEOUT_S, GroupAddress
from moe_runtime.front.weight_sync import (ADMIN_TIMEOUT_S, AdminResult, check_policy, disk_update, distributed_update,
                                           group_join, remove_written, sleep_command, wake_command, write_tensors)

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
    def engine(self) -> Front:
        """The front this LLM drives: admission, routing, outputs, `stats()` and `health()` (any layout)."""
        return self._engine

    @property
    def core(self) -> EngineCore:
        """The engine core of a one-rank engine, which runs in this process: what tests and benchmarks inspect
        (its model, scheduler, block manager, runner, sampler). Ranks in other processes have none here."""
        return self._engine.core

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

    # ---- weight sync and sleep (front/weight_sync.py) -------------------------------------------------------
    def update_weights(self, path: str, policy: str = "drain", checksums: bool = False) -> AdminResult:
        """Load new weights from the checkpoint directory `path` (the served model's tensors, names and shapes,
        all of them), on every rank; the prefix cache is flushed. `policy` for the requests in flight: "drain"
        (finish on the old weights first), "abort" (end now, finish_reason "abort") or "pause" (go on, with their
        KV, on the new weights). A refusal (a tensor missing, unknown, of another shape) changes nothing.
        `checksums`: each rank reports its expert slots' `SlotChecksum`s."""
        return self._admin(disk_update(path, checksums), policy)

    def update_weights_from_tensors(self, named_tensors, policy: str = "drain", checksums: bool = False
                                    ) -> AdminResult:
        """Load `named_tensors` ({name: tensor} or (name, tensor) pairs, transformers' names, plain dtypes: kept
        quantized weights are quantized again) from this process; only those tensors change (a module's tensors
        come together). They reach the ranks as a safetensors file in shared memory (no pickle)."""
        directory = write_tensors(named_tensors)
        try:
            return self._admin(disk_update(directory, checksums, partial=True), policy)
        finally:
            remove_written(directory)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update", backend: str = "gloo",
                                  timeout_s: float = JOIN_TIMEOUT_S) -> AdminResult:
        """Join the trainer's weight-update group (the trainer is rank 0 and hosts its store, e.g.
        `engine.weight_update_group.TrainerWeightSender`; engine rank r is rank_offset + r). Blocks until every
        member has joined: the trainer joins concurrently. `timeout_s`: how long the ranks wait for the trainer (to
        join, and in each of its broadcasts) before the call is refused; no request steps meanwhile. A second join
        leaves the earlier group first."""
        address = GroupAddress(str(master_address), int(master_port), int(rank_offset), int(world_size),
                               str(group_name), str(backend), float(timeout_s))
        return self._admin(group_join(address, self._engine.shape.world_size), "pause")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        policy: str = "drain", checksums: bool = False) -> AdminResult:
        """Receive these tensors from the trainer's broadcast (it sends them, in this order, concurrently) and load
        what each rank holds of them (its shard, its experts, replicas included)."""
        return self._admin(distributed_update(names, dtypes, shapes, checksums), policy)

    def sleep(self, level: int = 1) -> AdminResult:
        """Free the KV pool (the prefix cache is flushed) and move the weights to host memory (level 1), or drop
        them (level 2: `wake_up(reload=True)` or a full `update_weights` brings them back). Running requests finish
        first; new ones are refused (`EngineAsleepError`) until `wake_up`. Each rank's memory after it."""
        make = sleep_command(level)
        return self._admin(make, "drain", after=lambda result: setattr(self._engine.admin, "sleep_level", level))

    def wake_up(self, reload: bool = False) -> AdminResult:
        """Restore the KV pool and the weights (`reload`: load the checkpoint again after sleep level 2)."""
        return self._admin(wake_command(reload), "pause",
                           after=lambda result: setattr(self._engine.admin, "sleep_level", 0))

    def _admin(self, make, policy: str, after=None) -> AdminResult:
        check_policy(policy)
        if policy == "drain":
            self._engine.finish_running()
        elif policy == "abort":
            self._engine.abort_all()
        return self._engine.wait(self._engine.admin_command(make, after), timeout_s=ADMIN_TIMEOUT_S)

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
