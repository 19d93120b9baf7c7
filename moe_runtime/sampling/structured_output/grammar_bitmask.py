"""The grammar's verdict on the next token, for every constrained row of a batch at once.

One batched fill (xgrammar's `BatchGrammarMatcher`, in C++ threads) writes a packed bitmask
[B, ceil(V/32)] (int32, one bit per token) for the constrained rows, and one in-place op sets the
logits of every forbidden token of those rows to -inf. Rows without a grammar are untouched.
The mask is filled on the CPU (xgrammar's matchers live there) and moved to the logits' device.
A small batch is filled on the calling thread: handing a few rows to worker threads costs more than
filling them (hundreds of microseconds against tens, measured on 2 cores); from `PARALLEL_FROM_ROWS`
rows on, xgrammar's threads share the work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import xgrammar

from moe_runtime.sampling.structured_output.grammar_state import GrammarState


@dataclass
class BitmaskTimings:
    """Wall time spent filling and applying masks (the structured-output cost per step), cumulative."""

    seconds: float = 0.0
    calls: int = 0
    rows: int = 0


class GrammarBitmask:
    PARALLEL_FROM_ROWS = 64

    def __init__(self, max_threads: int = 1):
        self._serial = xgrammar.BatchGrammarMatcher(max_threads=1)
        self._parallel = xgrammar.BatchGrammarMatcher(max_threads=max_threads) if max_threads > 1 else None
        self.timings = BitmaskTimings()

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Mask logits [B, V] in place: row rows[i] keeps only what states[i] allows next."""
        if not rows:
            return
        started = time.perf_counter()
        batch, vocab = logits.shape
        bitmask = xgrammar.allocate_token_bitmask(batch, vocab)              # [B, ceil(V/32)] int32, all allowed
        filler = self._parallel if self._parallel is not None and len(rows) >= self.PARALLEL_FROM_ROWS else self._serial
        filler.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, indices=rows)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        backend = "cpu" if logits.device.type == "cpu" else "torch_native"  # no triton needed on GPU
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows, backend=backend)
        self.timings.seconds += time.perf_counter() - started
        self.timings.calls += 1
        self.timings.rows += len(rows)
