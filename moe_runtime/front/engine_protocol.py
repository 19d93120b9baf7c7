"""The engine face every front end uses (LLM, the async server engine): one process or many.

Implemented by `LocalEngine` (one rank, in process) and by `MultiprocessEngine` (ranks in worker
processes). Not thread-safe: one thread drives it (add_request/abort/step between steps). An
engine whose ranks live elsewhere is also an `EventDrivenEngine`: an asyncio loop can take in its
outputs as they arrive instead of calling `step()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.engine.outputs import RequestOutput
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.engine.request_limits import RequestLimits


@dataclass
class WorkerStats:
    """One DP attention worker's queue and KV cache."""

    dp_rank: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    steps: int = 0                  # forward steps run (lock-step ones with empty batches included)
    step_seconds: float = 0.0       # wall time in forward steps, cumulative
    moe_comm_seconds: float = 0.0   # ... of which in dispatch + combine (expert-parallel communication)
    compute_seconds: float = 0.0    # ... of which running this rank's layers (pipeline: the rest is bubble)
    prefix_cache_queries: int = 0   # tokens looked up in the prefix cache at admissions (readmissions too), cumulative
    prefix_cache_hits: int = 0      # ... of which found cached (not computed again)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / max(self.kv_blocks_total, 1)


@dataclass
class EngineStats:
    workers: list[WorkerStats] = field(default_factory=list)
    prompt_tokens: int = 0          # prompt tokens of admitted requests, since start
    generation_tokens: int = 0      # tokens generated, since start
    transfer: TransferStats | None = None   # KV transfers and queue times (the front's; None from a bare core)

    @property
    def running(self) -> int:
        return sum(w.running for w in self.workers)

    @property
    def waiting(self) -> int:
        return sum(w.waiting for w in self.workers)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(w.prefix_cache_queries for w in self.workers)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(w.prefix_cache_hits for w in self.workers)


@dataclass
class EngineHealth:
    healthy: bool
    detail: str = "ok"


class Engine(Protocol):
    tokenizer: object
    max_model_len: int
    limits: RequestLimits         # the one admission check; its structured-output cache is shared with the server

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    # P/D instances also take `export_kv=True` (prefill: park the prompt's KV after the first token; the last
    # output carries its `kv_handle`) or `import_kv=KVHandle` (decode: continue a request prefilled there).
    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def reset_prefix_cache(self) -> None: ...          # forget every cached KV block (prefix caching)
    def stats(self) -> EngineStats: ...
    def health(self) -> EngineHealth: ...
    def expert_load(self): ...                          # load_balancer.ExpertLoadSnapshot | None
    def rebalance_now(self) -> RebalanceEvent: ...      # plan + migrate now (EP with >1 rank)
    def rebalance_events(self) -> list[RebalanceEvent]: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class EventDrivenEngine(Protocol):
    """An engine that can hand its outputs to an asyncio loop as they arrive (no thread, no polling)."""

    def attach(self, on_outputs: Callable[[list[RequestOutput]], None], on_death: Callable[[str], None]) -> None: ...
    def detach(self) -> None: ...
    async def expert_load_async(self): ...
    async def rebalance_now_async(self) -> RebalanceEvent: ...
