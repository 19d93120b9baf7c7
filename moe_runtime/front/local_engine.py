"""One rank in this process, behind the front's face: the `Engine` that `LLM` and `moe-serve` drive
when the layout has a single rank.

The core (`EngineCore`) samples token ids; this front admits requests (the one `RequestLimits`
check) and turns the core's deltas into outputs (`OutputProcessor`: text, stop strings), exactly
as `MultiprocessEngine` does for ranks in other processes. As a prefill or decode instance it
also keeps the front half of KV transfers (`PrefillFront`, `DecodeFront`): their events (a
release, a pull that ended) arrive on other threads and only wake the engine thread (`set_wake`),
which applies them between steps.
"""
from __future__ import annotations

import time
from typing import Callable

from load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.disaggregation.decode_front import DecodeFront, ImportOutcome
from moe_runtime.disaggregation.import_spec import ImportSpec
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.front.engine_protocol import EngineHealth, EngineStats
from moe_runtime.errors import InvalidRequestError
from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.disaggregation.kv_transfer.keys import TransferKey
from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.front.output_processor import OutputProcessor, ProcessedStep
from moe_runtime.engine.outputs import RequestOutput, TokenDelta
from moe_runtime.disaggregation.prefill_front import PrefillFront, note_step_deltas
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.sampling.params import SamplingParams


class LocalEngine:
    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.limits: RequestLimits = self.core.limits()
        self.outputs = OutputProcessor(self.tokenizer)
        self.transfer_stats = TransferStats(config.disaggregation_mode)
        self._undelivered: list[RequestOutput] = []      # outputs made outside a step (an import's first token)
        self._wake: Callable[[], None] | None = None
        self._woken = False                               # a transfer event is waiting for the engine thread
        self.prefill: PrefillFront | None = None
        self.decode: DecodeFront | None = None
        if config.disaggregation_mode != "none":
            key = TransferKey.shared(config.kv_transfer_key_file)
            if self.core.exports is not None:
                self.prefill = PrefillFront(key, config.kv_transfer_host, config.kv_transfer_timeout_s,
                                            self.transfer_stats)
                self.prefill.wake = self._wake_up
            else:
                self.decode = DecodeFront(key, config.kv_transfer_timeout_s, self.transfer_stats)
            self.core.wake = self._wake_up

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake()` is called (from another thread) when a KV transfer event waits for the engine thread."""
        self._wake = wake

    def _wake_up(self) -> None:
        self._woken = True
        if self._wake is not None:
            self._wake()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    export_kv: bool = False, import_kv: KVHandle | None = None) -> None:
        """Admit a request; `export_kv` (prefill instance): park its KV after its first token, and its last
        output carries a `kv_handle`; `import_kv` (decode instance): it was prefilled there, pull its KV."""
        if request_id in self.outputs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.limits.check(prompt_token_ids, params)
        prompt = list(prompt_token_ids)
        if import_kv is not None:
            self._add_import(request_id, prompt, params, import_kv)
            return
        self.core.add_request(request_id, prompt, params, export_kv=export_kv)
        self.outputs.add(request_id, prompt, params)

    def _add_import(self, request_id: str, prompt: list[int], params: SamplingParams, handle: KVHandle) -> None:
        if self.decode is None:
            raise InvalidRequestError("kv_transfer_params: this instance is not --disaggregation-mode decode")
        handle = self.decode.verify(handle, prompt, params)
        first_logprob = handle.first_logprob.token_logprob() if handle.first_logprob is not None else None
        self.core.add_import(ImportSpec(request_id, prompt, params, handle.first_token, handle.request_id,
                                        list(handle.shards), first_logprob, handle.generator_state))
        self.outputs.add(request_id, prompt, params)
        self.decode.start(request_id, 0, {0}, handle)
        first = TokenDelta(request_id, [handle.first_token], [first_logprob] if params.logprobs is not None
                           and first_logprob is not None else None)
        self._undelivered.extend(self._outputs_of(self.outputs.process([first])))

    def abort(self, request_id: str) -> bool:
        self.core.abort(request_id)
        if self.decode is not None:
            self.decode.abort(request_id)
        return self.outputs.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished() or bool(self._undelivered) or self._transfer_due()

    def _transfer_due(self) -> bool:
        if self._woken:
            return True
        if self.prefill is not None and self.prefill.has_due:
            return True
        deadline = self.decode.next_deadline if self.decode is not None else None
        return deadline is not None and deadline <= time.monotonic()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        outputs, self._undelivered = self._undelivered, []
        outputs.extend(self._service_transfers())
        deltas = self.core.step()
        sampled_at = time.time()
        processed = self.outputs.process(deltas)
        for request_id, reason in processed.ended.items():
            self.core.abort(request_id, reason)
        for output in processed.outputs:
            output.sampled_at = sampled_at
        note_step_deltas(self.prefill, self.transfer_stats, 0, deltas, processed.outputs,
                         lambda: [self.core.kv_shard()], self.core.release_export)
        return outputs + processed.outputs

    def _service_transfers(self) -> list[RequestOutput]:
        """Apply what happened to KV transfers since the last step: releases, landed pulls, timeouts."""
        self._woken = False
        outputs: list[RequestOutput] = []
        if self.prefill is not None:
            for parked in self.prefill.take_due():
                self.core.release_export(parked.request_id)
        if self.decode is not None:
            for result in self.core.take_landed_imports():
                outcome = self.decode.landed(0, result.request_id, result.error, result.num_bytes, result.seconds)
                if outcome is not None:
                    outputs.extend(self._settle(outcome))
            for outcome in self.decode.take_expired():
                outputs.extend(self._settle(outcome))
        return outputs

    def _settle(self, outcome: ImportOutcome) -> list[RequestOutput]:
        if outcome.error is None:
            self.core.activate_import(outcome.request_id)
            return []
        self.core.abort(outcome.request_id, "error")
        return self._outputs_of(self.outputs.process([TokenDelta(outcome.request_id, [], None, "error",
                                                                 outcome.error)]))

    def _outputs_of(self, processed: ProcessedStep) -> list[RequestOutput]:
        """Outputs made outside a step; a request they ended (a stop string in the first token) is aborted."""
        for request_id, reason in processed.ended.items():
            self.core.abort(request_id, reason)
            if self.decode is not None:
                self.decode.abort(request_id)
        return processed.outputs

    def stats(self) -> EngineStats:
        stats = self.core.stats()
        stats.transfer = self.transfer_stats.snapshot()
        return stats

    def health(self) -> EngineHealth:
        return self.core.health()

    def expert_load(self):
        return self.core.expert_load()

    def rebalance_now(self) -> RebalanceEvent:
        return self.core.rebalance_now()

    def rebalance_events(self) -> list[RebalanceEvent]:
        return self.core.rebalance_events()

    def shutdown(self) -> None:
        for front in (self.prefill, self.decode):
            if front is not None:
                front.close()
        self.core.shutdown()
