"""Which earlier tokens an attention layer's queries read: its span (full, a sliding window, a chunk).

The layer applies it as a mask; the KV cache manager (moe_runtime/kv_blocks/kv_groups.py) keeps only the blocks
a windowed span can still read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FULL = "full"
SLIDING = "sliding"
CHUNKED = "chunked"
SPAN_CODES = {FULL: 0, SLIDING: 1, CHUNKED: 2}   # what a Triton kernel takes as its span constant


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

    @property
    def code(self) -> int:
        """The span kind as the Triton kernels take it (a compile-time constant): 0 full, 1 sliding, 2 chunked."""
        return SPAN_CODES[self.kind]

    def first_needed_tensor(self, positions: torch.Tensor) -> torch.Tensor:
        """`first_needed` of every position in a tensor, on its device (a captured decode step computes its
        rows' first keys this way: no host read). Negative positions (pad rows: context 0) give 0."""
        if self.kind == SLIDING:
            return (positions - (self.size - 1)).clamp(min=0)
        if self.kind == CHUNKED:
            return (torch.div(positions, self.size, rounding_mode="floor") * self.size).clamp(min=0)
        return torch.zeros_like(positions)

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Causal mask under this span: query positions [n, 1] against key positions [1, S] -> [n, S] bool."""
        return (key_pos <= query_pos) & (key_pos >= self.first_needed_tensor(query_pos))

    @classmethod
    def coerce(cls, span: "AttentionSpan | int | None") -> "AttentionSpan":
        """A span from what attention callers pass: a span, a sliding window's size (the seam's former
        `sliding_window` argument, still taken), or None for full attention."""
        if span is None:
            return cls()
        if isinstance(span, AttentionSpan):
            return span
        return cls(SLIDING, int(span))
