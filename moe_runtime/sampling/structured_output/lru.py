"""A small thread-safe LRU map bounded in entries and in bytes (what a compiled grammar reports)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """`get` refreshes an entry; `put` evicts the least recently used ones beyond `max_entries` or
    `max_bytes` (sizes from `size_of`; one entry larger than `max_bytes` is still kept, alone).

    Callers compute a missing value outside the lock: two threads missing the same key at once both
    compute it (harmless, the later `put` wins) instead of one blocking every other lookup.
    """

    def __init__(self, max_entries: int, max_bytes: int | None = None, size_of: Callable[[V], int] = lambda _: 0):
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V) -> None:
        size = self._size_of(value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or
                                              (self.max_bytes is not None and self._bytes > self.max_bytes)):
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    @property
    def bytes(self) -> int:
        return self._bytes
