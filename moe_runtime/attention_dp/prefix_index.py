"""The front's view of which DP attention worker holds which cached KV blocks (by prefix hash).

Two sources, each bounded:

- **held**: what each worker's prefix cache holds, kept exact by the net changes the worker reports
  with every step (`PrefixCacheEvents`: stored, evicted, cleared), applied in the order the worker
  sent them. A worker holds at most its number of KV blocks, so the index is at most
  dp_size x num_kv_blocks hashes, whatever the traffic.
- **expected**: the blocks of requests routed to a worker whose prefill has not been reported yet.
  Without them a burst of requests sharing a prefix would be scattered before the first one's
  prefill is reported; with them the burst follows the first request. A request's expected blocks
  are dropped at its first output (by then the worker's report of its stored blocks has arrived:
  the same `StepOutputs` carries both), or when it ends or is aborted, so they are bounded by the
  requests in flight.

Why reports rather than the front recording only what it routed: a worker evicts blocks when its
memory is needed, and only the worker knows which; a front-only record would keep routing to
prefixes that are gone.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moe_runtime.kv_blocks.prefix_cache import PrefixCacheEvents


@dataclass(frozen=True)
class ExpectedBlocks:
    dp_rank: int
    hashes: list[int]


class PrefixCacheIndex:
    def __init__(self, dp_size: int):
        self._held: list[set[int]] = [set() for _ in range(dp_size)]
        self._expected_counts: list[Counter] = [Counter() for _ in range(dp_size)]
        self._expected: dict[str, ExpectedBlocks] = {}       # request id -> blocks it will leave on its worker

    def apply(self, dp_rank: int, events: PrefixCacheEvents) -> None:
        """A worker's report of its cache's changes."""
        held = self._held[dp_rank]
        if events.cleared:
            held.clear()
        held.difference_update(events.evicted)
        held.update(events.stored)

    def cached_blocks(self, dp_rank: int, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the worker holds (or will hold once requests routed there
        have been prefilled)."""
        held, expected = self._held[dp_rank], self._expected_counts[dp_rank]
        count = 0
        for block_hash in hashes:
            if block_hash not in held and not expected[block_hash]:
                break
            count += 1
        return count

    def expect(self, request_id: str, dp_rank: int, hashes: list[int]) -> None:
        """`request_id` was routed to `dp_rank`: its prompt's blocks will be cached there."""
        self._expected[request_id] = ExpectedBlocks(dp_rank, hashes)
        self._expected_counts[dp_rank].update(hashes)

    def settle(self, request_id: str) -> None:
        """The request produced output (its blocks are reported now), ended or was aborted."""
        expected = self._expected.pop(request_id, None)
        if expected is not None:
            counts = self._expected_counts[expected.dp_rank]
            counts.subtract(expected.hashes)
            for block_hash in expected.hashes:
                if counts[block_hash] <= 0:
                    counts.pop(block_hash, None)

    def num_held(self, dp_rank: int) -> int:
        return len(self._held[dp_rank])

    @property
    def num_expected_requests(self) -> int:
        return len(self._expected)
