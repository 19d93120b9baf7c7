"""Turning requests into token ids off the event loop, with the large ones taken a few at a time.

Rendering and tokenizing run in worker threads (`asyncio.to_thread`), so the loop keeps serving streams. A
large body (over `LARGE_BODY_BYTES`) may still hold hundreds of MB of the tokenizer's buffers while it
converts; eight at once raised the front from 0.7 to 3.1 GB in red team round 3, and kept it there. So
large conversions take one of `LARGE_CONVERSIONS` slots (the others wait their turn, as requests waiting
for the engine do), and after one the allocator hands its free memory back to the system (glibc's
`malloc_trim`; elsewhere a no-op), so a burst does not leave the front's memory at its high-water mark.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from dataclasses import dataclass, field
from typing import Callable, TypeVar

Result = TypeVar("Result")

LARGE_BODY_BYTES = 64 * 1024   # as json_body's INLINE_PARSE_BYTES: larger bodies parse off the loop too
LARGE_CONVERSIONS = 2          # large bodies converted at once (the machine's cores are the engine's)


def trim_malloc() -> Callable[[], None]:
    """glibc's `malloc_trim(0)`: return the heap's free pages to the system; a no-op without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


@dataclass
class ConversionThreads:
    """One per app: `run(convert, *args, body_bytes=...)` in a worker thread, large ones through the slots."""

    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LARGE_CONVERSIONS))
    release_memory: Callable[[], None] = field(default_factory=trim_malloc)

    async def run(self, convert: Callable[..., Result], *args, body_bytes: int | None) -> Result:
        """`body_bytes`: the request's Content-Length (None: unknown, e.g. a chunked upload: counted as large)."""
        if body_bytes is not None and body_bytes <= LARGE_BODY_BYTES:
            return await asyncio.to_thread(convert, *args)
        async with self.slots:
            try:
                return await asyncio.to_thread(convert, *args)
            finally:
                await asyncio.to_thread(self.release_memory)


def declared_length(headers) -> int | None:
    """A request's Content-Length, or None when it has none (or a malformed one: the size gate refused those)."""
    try:
        return int(headers.get("content-length"))
    except (TypeError, ValueError):
        return None
