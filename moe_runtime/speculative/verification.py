"""Verifying drafts: one target forward scores a sequence's last token and its d drafts (1 + d logits rows);
the target's own choice at each row decides.

Each row is sampled as the sequence would be at that position without speculation: a view of the sequence
whose output already holds the drafts before the row (penalties, min_tokens and the seeded position see the
same context). The longest prefix of drafts equal to the target's greedy choices is accepted, and the
target's token after it is appended too: 1 to d + 1 tokens per step, each the one plain greedy decoding would
have produced (`Speculation` drafts only for greedy requests). The rejected drafts' K/V is then rolled back
(`BlockManager.roll_back`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from moe_runtime.engine.block_manager import BlockManager
from moe_runtime.engine.outputs import error_message
from moe_runtime.engine.sequence import FinishReason, Sequence
from moe_runtime.sampling.device_draw import SampleResult
from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.speculative.speculation import Speculation   # also the engine core's import of it


def row_views(seq: Sequence) -> list[Sequence]:
    """`seq` as it stands at each of its logits rows: row j has its first j drafts in its output."""
    if not seq.draft_token_ids:
        return [seq]
    return [seq] + [dataclasses.replace(seq, output_token_ids=seq.output_token_ids + seq.draft_token_ids[:j])
                    for j in range(1, seq.logit_rows)]


class VerifyingSampler:
    """The engine's sampler with draft verification around it: a batch with no drafts goes straight through."""

    def __init__(self, sampler, speculation: Speculation | None):
        self.sampler = sampler
        self.speculation = speculation

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:  # logits [R, V]
        if not any(seq.draft_token_ids for seq in seqs):
            return self.sampler(logits, seqs)                 # R == B; a failure is the caller's to split
        views = [row_views(seq) for seq in seqs]
        try:
            drawn = self.sampler(logits, [view for rows in views for view in rows])
            parts = self._split(drawn, [len(rows) for rows in views])
        except Exception:  # noqa: BLE001 - one sequence's rows at a time, as EngineCore does for one row each
            parts, first = [], 0
            for rows in views:
                try:
                    parts.append(self.sampler(logits[first : first + len(rows)], rows))
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    parts.append(SampleResult([SampleResult.NO_TOKEN] * len(rows), [None] * len(rows),
                                              [error_message(exc)] * len(rows)))
                first += len(rows)
        return SampleResult.concat([self._accept(seq, part) for seq, part in zip(seqs, parts)])

    @staticmethod
    def _split(drawn: SampleResult, sizes: list[int]) -> list[SampleResult]:
        parts, first = [], 0
        for size in sizes:
            stop = first + size
            parts.append(SampleResult(drawn.token_ids[first:stop], drawn.logprobs[first:stop], drawn.errors[first:stop]))
            first = stop
        return parts

    def _accept(self, seq: Sequence, rows: SampleResult) -> SampleResult:
        """One sequence's row: its accepted drafts, then the target's token at the first mismatch (or after all)."""
        drafts = seq.draft_token_ids
        accepted = 0
        while (accepted < len(drafts) and rows.errors[accepted] is None
               and rows.token_ids[accepted] == drafts[accepted]):
            accepted += 1
        if drafts and self.speculation is not None:
            self.speculation.record(len(drafts), accepted)
        kept = [(drafts[j], rows.logprobs[j]) for j in range(accepted)]
        return SampleResult([rows.token_ids[accepted]], [rows.logprobs[accepted]], [rows.errors[accepted]], [kept])


def emit_tokens(seq: Sequence, tokens: list[tuple[int, TokenLogprob | None]],
                advance: Callable[[Sequence, int, TokenLogprob | None], FinishReason | None],
                block_manager: BlockManager) -> tuple[list[int], list[TokenLogprob | None], FinishReason | None]:
    """Append `tokens` (accepted drafts, then the sampled token) one by one until the request finishes; a sequence
    that verified drafts has its rejected drafts' K/V rolled back. The tokens and logprobs appended, and why the
    request finished (None: it goes on)."""
    emitted, logprobs, reason = [], [], None
    for token, logprob in tokens:
        reason = advance(seq, token, logprob)
        emitted.append(token)
        logprobs.append(logprob)
        if reason is not None:
            break
    if seq.draft_token_ids:
        seq.draft_token_ids = []
        if reason is None:
            block_manager.roll_back(seq)
    return emitted, logprobs, reason
