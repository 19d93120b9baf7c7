"""Assigns each new request to a DP attention worker by load, not round-robin."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerLoad:
    dp_rank: int
    requests: int = 0             # requests assigned and not finished
    tokens: int = 0               # their tokens so far (prompt + generated): running + waiting work
    kv_blocks_free: int = 0       # as last reported by the worker
    kv_blocks_total: int = 0


@dataclass
class RoutingDecision:
    request_id: str
    dp_rank: int
    loads: list[WorkerLoad]       # the loads the choice was made on


@dataclass
class DPRouter:
    """Least outstanding tokens wins; ties go to the worker with more free KV blocks, then the lower rank."""

    loads: list[WorkerLoad]
    _assigned: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (dp_rank, tokens)
    last_decision: RoutingDecision | None = None

    @classmethod
    def for_workers(cls, dp_size: int, kv_blocks_total: int) -> "DPRouter":
        return cls([WorkerLoad(d, kv_blocks_free=kv_blocks_total, kv_blocks_total=kv_blocks_total)
                    for d in range(dp_size)])

    def choose(self, request_id: str, num_tokens: int) -> RoutingDecision:
        best = min(self.loads, key=lambda w: (w.tokens, -w.kv_blocks_free, w.dp_rank))
        decision = RoutingDecision(request_id, best.dp_rank, [WorkerLoad(**vars(w)) for w in self.loads])
        best.requests += 1
        best.tokens += num_tokens
        self._assigned[request_id] = (best.dp_rank, num_tokens)
        self.last_decision = decision
        return decision

    def dp_rank_of(self, request_id: str) -> int | None:
        entry = self._assigned.get(request_id)
        return None if entry is None else entry[0]

    def grow(self, request_id: str, new_tokens: int) -> None:
        entry = self._assigned.get(request_id)
        if entry is not None:
            dp, tokens = entry
            self._assigned[request_id] = (dp, tokens + new_tokens)
            self.loads[dp].tokens += new_tokens

    def release(self, request_id: str) -> None:
        entry = self._assigned.pop(request_id, None)
        if entry is not None:
            dp, tokens = entry
            self.loads[dp].requests -= 1
            self.loads[dp].tokens -= tokens

    def report_kv(self, dp_rank: int, free: int, total: int) -> None:
        self.loads[dp_rank].kv_blocks_free = free
        self.loads[dp_rank].kv_blocks_total = total
