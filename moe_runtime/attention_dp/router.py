"""Assigns each new request to a DP attention worker by load, not round-robin, and (with prefix caching)
by the prefill it saves.

Cache-aware, a worker's expected work for a request is its outstanding tokens plus what the request
would prefill there: its prompt less the longest prefix that worker has cached or is about to
(`PrefixCacheIndex`). Among the workers whose expected work is within one prompt's length of the
lowest, the one saving the most prefill wins (then the lowest work). Choosing by expected work alone
is myopic: in a burst, a second request of a prefix goes to the idle worker, which then computes the
prefix again, and so does every prefix, doubling the prefill of a mixed workload; the tolerance of one
prompt keeps each prefix on one worker until it is really behind, and still spreads a single hot prefix
over every worker (each computes it once). Nothing cached anywhere: plain least load."""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.attention_dp.prefix_index import PrefixCacheIndex


@dataclass
class WorkerLoad:
    dp_rank: int
    requests: int = 0             # requests assigned and not finished
    tokens: int = 0               # their tokens so far (prompt + generated, less a prefix cached there when
                                  # routed): running + waiting work
    kv_blocks_free: int = 0       # as last reported by the worker
    kv_blocks_total: int = 0


@dataclass
class RoutingDecision:
    request_id: str
    dp_rank: int
    loads: list[WorkerLoad]       # the loads the choice was made on
    cached_tokens: list[int] = field(default_factory=list)   # per worker: the prompt prefix it holds (cache-aware)


@dataclass
class DPRouter:
    """Least outstanding tokens wins (cache-aware: see the module's docstring); ties go to the worker with
    more free KV blocks, then the lower rank."""

    loads: list[WorkerLoad]
    _assigned: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (dp_rank, tokens)
    last_decision: RoutingDecision | None = None
    prefix_index: PrefixCacheIndex | None = None    # set: cache-aware routing
    block_size: int = 16

    @classmethod
    def for_workers(cls, dp_size: int, kv_blocks_total: int, cache_aware: bool = False,
                    block_size: int = 16) -> "DPRouter":
        return cls([WorkerLoad(d, kv_blocks_free=kv_blocks_total, kv_blocks_total=kv_blocks_total)
                    for d in range(dp_size)], prefix_index=PrefixCacheIndex(dp_size) if cache_aware else None,
                   block_size=block_size)

    def choose(self, request_id: str, num_tokens: int, block_hashes: list[int] | None = None) -> RoutingDecision:
        """Pick the worker for a request of `num_tokens` prompt tokens; `block_hashes` (the prompt's full
        blocks, `moe_runtime.kv_blocks.prefix_hash`) make the choice cache-aware when this router keeps an index."""
        cached = [0] * len(self.loads)
        if self.prefix_index is not None and block_hashes:
            usable = block_hashes[: (num_tokens - 1) // self.block_size]    # a worker computes at least one token
            cached = [self.prefix_index.cached_blocks(w.dp_rank, usable) * self.block_size for w in self.loads]
        if any(cached):
            work = [w.tokens + num_tokens - cached[w.dp_rank] for w in self.loads]   # by dp_rank
            candidates = [w for w in self.loads if work[w.dp_rank] <= min(work) + num_tokens]
            best = min(candidates, key=lambda w: (-cached[w.dp_rank], work[w.dp_rank], -w.kv_blocks_free, w.dp_rank))
        else:
            best = min(self.loads, key=lambda w: (w.tokens, -w.kv_blocks_free, w.dp_rank))
        decision = RoutingDecision(request_id, best.dp_rank, [WorkerLoad(**vars(w)) for w in self.loads], cached)
        work = num_tokens - cached[best.dp_rank]          # a cached prefix is neither computed nor held again
        best.requests += 1
        best.tokens += work
        self._assigned[request_id] = (best.dp_rank, work)
        if self.prefix_index is not None and block_hashes:
            self.prefix_index.expect(request_id, best.dp_rank, block_hashes)
        self.last_decision = decision
        return decision

    def first_output(self, request_id: str) -> None:
        """The request's prefill is done and reported: its blocks are in its worker's report now."""
        if self.prefix_index is not None:
            self.prefix_index.settle(request_id)

    def report_cache(self, dp_rank: int, events) -> None:
        """A worker's prefix-cache changes (`PrefixCacheEvents`)."""
        if self.prefix_index is not None:
            self.prefix_index.apply(dp_rank, events)

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
        self.first_output(request_id)
        entry = self._assigned.pop(request_id, None)
        if entry is not None:
            dp, tokens = entry
            self.loads[dp].requests -= 1
            self.loads[dp].tokens -= tokens

    def report_kv(self, dp_rank: int, free: int, total: int) -> None:
        self.loads[dp_rank].kv_blocks_free = free
        self.loads[dp_rank].kv_blocks_total = total
