"""The face of the front that callers drive (`LLM`, `AsyncEngine`): `Front` implements it; test doubles too.

Not thread-safe: one thread drives it, either by blocking calls (`step`, `wait`) or, once `attach`ed,
from an asyncio loop that gets outputs as they arrive. Snapshots and rebalances answer with futures,
which a blocking caller waits for with `wait` and a loop awaits (`asyncio.wrap_future`).
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable, Protocol

from moe_runtime.load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.records.outputs import RequestOutput
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.engine.stats import EngineHealth, EngineStats
from moe_runtime.sampling.params import SamplingParams


class Engine(Protocol):
    tokenizer: object
    max_model_len: int
    limits: RequestLimits         # the one admission check; its structured-output cache is shared with the server

    def prepare(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                export_kv: bool = False, import_kv: KVHandle | None = None):
        """Check a request (may run in a worker thread); the admission `admit` takes."""
        ...

    def admit(self, admission) -> None: ...
    def refuse_import(self, handle: KVHandle | None) -> None:
        """A request that came with this KV handle was refused: its prefill instance may free the KV now."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    # P/D instances also take `export_kv=True` (prefill: park the prompt's KV after the first token; the last
    # output carries its `kv_handle`) or `import_kv=KVHandle` (decode: continue a request prefilled there).
    def abort(self, request_id: str) -> bool: ...
    def reset_prefix_cache(self) -> None: ...          # forget every cached KV block (prefix caching)
    def stats(self) -> EngineStats: ...
    def health(self) -> EngineHealth: ...
    def expert_load(self) -> concurrent.futures.Future: ...      # of load_balancer.ExpertLoadSnapshot | None
    def rebalance_now(self) -> concurrent.futures.Future: ...    # of a RebalanceEvent (EP with > 1 rank)
    def rebalance_events(self) -> list[RebalanceEvent]: ...
    # weight updates, sleep and wake (front/weight_sync.py): one command to every rank, a future of their answers
    def admin_command(self, make: Callable[[int], object], after=None) -> concurrent.futures.Future: ...
    def abort_all(self) -> int: ...          # every request in flight ends now, finish_reason "abort"
    def finish_running(self) -> None: ...    # blocking driver: step until nothing is in flight
    def shutdown(self) -> None: ...

    # the blocking driver
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def wait(self, future: concurrent.futures.Future, timeout_s: float | None = None): ...

    # the loop driver
    def attach(self, on_outputs: Callable[[list[RequestOutput]], None], on_death: Callable[[str], None]) -> None: ...
    def detach(self) -> None: ...
