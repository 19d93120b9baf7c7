"""The nonces of the KV handles a decode instance already took: a handle is good for one import.

A handle is signed, but it travels through the router (and HTTP clients' hands), so a copy could be
sent again: without this, a used handle would start a pull from blocks the prefill instance already
freed (the puller then waits `NOT_PARKED_GRACE_S` for them, holding its transfer thread), or race
the first import for the blocks it is pulling. Each handle carries a random nonce and a signed
expiry (the prefill's transfer timeout: its parked blocks are freed then anyway); a nonce is
remembered until its handle expires, so the memory holds at most the handles taken within one
timeout, and a hard cap (`MAX_REMEMBERED`) bounds it even against a prefill instance whose clock is
far ahead: past the cap new handles are refused (nothing is forgotten early, which would let a
replay in).

Thread-safe: a long prompt's admission (and so its handle's check) runs in a worker thread.
"""
from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

MAX_REMEMBERED = 65536     # ~ 10 MB; a decode instance takes far fewer handles per transfer timeout


class NonceRefused(Exception):
    """The nonce was already used, or too many unexpired ones are remembered to take another."""


@dataclass
class UsedNonces:
    capacity: int = MAX_REMEMBERED
    clock: Callable[[], float] = time.time       # wall clock: expiries come from the prefill's clock
    _expiry: dict[str, float] = field(default_factory=dict)
    _by_expiry: list[tuple[float, str]] = field(default_factory=list)   # a heap, to forget the expired
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def use(self, nonce: str, expires_at: float) -> None:
        """Remember `nonce` until `expires_at`; `NonceRefused` if it is remembered already (a replay) or the
        memory is full of unexpired nonces."""
        with self._lock:
            self._forget_expired()
            if nonce in self._expiry:
                raise NonceRefused("already used")
            if len(self._expiry) >= self.capacity:
                raise NonceRefused(f"{len(self._expiry)} handles taken within their expiry (the most "
                                   f"remembered); retry later")
            self._expiry[nonce] = expires_at
            heapq.heappush(self._by_expiry, (expires_at, nonce))

    def __contains__(self, nonce: str) -> bool:
        with self._lock:
            self._forget_expired()
            return nonce in self._expiry

    def __len__(self) -> int:
        with self._lock:
            self._forget_expired()
            return len(self._expiry)

    def _forget_expired(self) -> None:
        now = self.clock()
        while self._by_expiry and self._by_expiry[0][0] <= now:
            _, nonce = heapq.heappop(self._by_expiry)
            self._expiry.pop(nonce, None)
