"""The requests whose KV blocks a prefill rank keeps for a decode instance to pull.

The engine (the rank's main thread) parks a request's block ids here when its prefill is done and
removes them before it frees the blocks; the block server's thread reads the blocks of a parked
request under the same lock. So once `release` returns, no read of those blocks is in progress or
can start, and the blocks can be handed to another request.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ParkedKV:
    block_ids: tuple[int, ...]    # the request's block table (its prompt's blocks)
    num_tokens: int
    state_slot: int = -1          # its recurrent-state slot (hybrid models' linear layers; -1: none)


class UnknownExport(LookupError):
    """The request is not parked here (never was, released, or timed out)."""


class ExportRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: dict[str, ParkedKV] = {}

    def park(self, request_id: str, block_ids: list[int], num_tokens: int, state_slot: int = -1) -> None:
        with self._lock:
            self._parked[request_id] = ParkedKV(tuple(block_ids), num_tokens, state_slot)

    def release(self, request_id: str) -> bool:
        """Forget the request; no read of its blocks runs after this returns."""
        with self._lock:
            return self._parked.pop(request_id, None) is not None

    def read(self, request_id: str, reader: Callable[[ParkedKV], T]) -> T:
        """`reader(parked)` while the request's blocks cannot be released; `UnknownExport` if not parked."""
        with self._lock:
            parked = self._parked.get(request_id)
            if parked is None:
                raise UnknownExport(f"request {request_id!r} has no parked KV here (released or timed out)")
            return reader(parked)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._parked

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)
