"""Which keys a query reads, as the attention kernels take it: a layer's span (full, sliding window, chunk).

The kernels do not import the runtime: they read the span through this Protocol, which
`moe_runtime.layers.attention_span.AttentionSpan` satisfies. A query at position p reads keys
[first_needed(p), p]: 0 for full attention, max(p - W + 1, 0) for a sliding window of W (transformers'
keys > p - W), p // C * C for a chunk of C (Llama 4's `attention_chunk_size`).

Keys before the first a step's queries read may lie in blocks a windowed KV cache group has freed (their
table entries point at a scratch block with anything in it), so a kernel must neither let them into a score
nor multiply their values by a zero probability (NaN * 0 is NaN): the torch paths cut them off before the
matmuls, the Triton kernels never load them.
"""
from __future__ import annotations

from typing import Protocol

import torch


class KeySpan(Protocol):
    kind: str
    size: int | None

    @property
    def windowed(self) -> bool: ...

    @property
    def code(self) -> int: ...          # 0 full, 1 sliding, 2 chunked: the Triton kernels' span constant

    def first_needed(self, position: int) -> int: ...

    def first_needed_tensor(self, positions: torch.Tensor) -> torch.Tensor: ...

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor: ...


def is_windowed(span: KeySpan | None) -> bool:
    return span is not None and span.windowed


def span_constants(span: KeySpan | None) -> tuple[int, int]:
    """(span code, size) for a Triton launch: (0, 0) for full attention."""
    if not is_windowed(span):
        return 0, 0
    return span.code, int(span.size)
