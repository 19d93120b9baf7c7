"""Which earlier tokens an attention layer's queries read: its span (full, a sliding window, a chunk).

The layer applies it as a mask; the KV cache manager (moe_runtime/engine/kv_groups.py) keeps only the blocks
a windowed span can still read.
"""
from __future__ import annotations

from dataclasses import dataclass

FULL = "full"
SLIDING = "sliding"
CHUNKED = "chunked"


@dataclass(frozen=True)
class AttentionSpan:
    """Which earlier tokens a query at position p attends to: all (full), the last `size` including itself
    (sliding: keys > p - size, transformers' sliding_window), or those of its own chunk (chunked: keys in
    [p // size * size, p])."""

    kind: str = FULL
    size: int | None = None

    def __post_init__(self):
        if self.kind not in (FULL, SLIDING, CHUNKED):
            raise ValueError(f"attention span kind {self.kind!r} is not one of {FULL}, {SLIDING}, {CHUNKED}")
        if (self.kind == FULL) != (self.size is None) or (self.size is not None and self.size < 1):
            raise ValueError(f"attention span {self.kind} needs a size >= 1 exactly when windowed, got {self.size}")

    @property
    def windowed(self) -> bool:
        return self.kind != FULL

    def first_needed(self, position: int) -> int:
        """The first key position a query at `position` reads."""
        if self.kind == SLIDING:
            return max(position - self.size + 1, 0)
        if self.kind == CHUNKED:
            return position // self.size * self.size
        return 0

    def max_span(self) -> int:
        """The most keys a query reads (None: unbounded) as a token count, for sizing a pool."""
        return self.size
