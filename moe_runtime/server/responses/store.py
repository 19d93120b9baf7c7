"""Stored responses, for `previous_response_id` and GET /v1/responses/{id}: bounded, per API key, expiring.

What a follow-up needs of a response is its conversation: the messages it was prompted with (less its
instructions, which OpenAI does not carry over) and its output as the assistant's turn. Each entry keeps that
and the response body. The store is memory-bounded (a byte budget over the entries' JSON sizes, oldest
evicted first), entries expire after `ttl_s`, and each tenant (the API key's index, `server.auth`) sees only
its own: another key's response id is "not found", exactly like an unknown one, so ids leak nothing.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from moe_runtime.server.protocol import ChatMessage
from moe_runtime.server.server_config import DEFAULT_RESPONSE_STORE_BYTES, DEFAULT_RESPONSE_TTL_S


@dataclass(frozen=True)
class StoredResponse:
    conversation: tuple[ChatMessage, ...]   # prompt messages (without instructions) + the output's assistant turn
    body: dict                              # the response as returned
    size: int                               # bytes counted against the budget
    stored_at: float


@dataclass
class ResponseStore:
    max_bytes: int = DEFAULT_RESPONSE_STORE_BYTES
    ttl_s: float = DEFAULT_RESPONSE_TTL_S
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[tuple[int | None, str], StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, tenant: int | None, response_id: str, conversation: list[ChatMessage], body: dict,
            size: int) -> bool:
        """Keep a response; False when it alone is larger than the whole budget (then it is not kept)."""
        if size > self.max_bytes:
            return False
        with self._lock:
            self._expire()
            key = (tenant, response_id)
            if key in self._entries:
                self._bytes -= self._entries.pop(key).size
            while self._entries and self._bytes + size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size
            self._entries[key] = StoredResponse(tuple(conversation), body, size, self.clock())
            self._bytes += size
            return True

    def get(self, tenant: int | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            return self._entries.get((tenant, response_id))

    def delete(self, tenant: int | None, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop((tenant, response_id), None)
            if entry is None:
                return False
            self._bytes -= entry.size
            return True

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        """Entries are in insertion order, so the expired ones lead."""
        cutoff = self.clock() - self.ttl_s
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if oldest.stored_at > cutoff:
                return
            del self._entries[key]
            self._bytes -= oldest.size
