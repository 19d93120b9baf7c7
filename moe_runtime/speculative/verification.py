"""Verifying drafts: one target forward scores a sequence's last token and its d drafts (1 + d logits rows);
the target's distribution at each row decides (`rejection_sampling`).

Each row is processed as the sequence would be at that position without speculation: a view of the sequence
whose output already holds the drafts before the row (penalties, min_tokens and the seeded position see the
same context). Greedy rows accept the longest prefix of drafts equal to the target's argmax, then emit the
argmax after it: exactly the tokens plain greedy decoding produces. Sampled rows accept each draft with the
target's probability of it and draw the first rejected row's token from the residual (the bonus row's from
the target): tokens distributed as plain sampling's. Either way 1 to d + 1 tokens per step, decided on the
device and read back with the step's one result copy. The rejected drafts' K/V is then rolled back
(`BlockManager.roll_back`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from moe_runtime.errors import error_message
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.records.sequence import FinishReason, Sequence
from moe_runtime.sampling.host_reads import step_result_transfer
from moe_runtime.sampling.device_draw import DeviceDraw, DrawStatus, SampleResult
from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.sampling.sampler import SampledRows
from moe_runtime.speculative.rejection_sampling import (RowLayout, emit, greedy_verdicts, sampled_verdicts)
from moe_runtime.speculative.speculation import Speculation   # also the engine core's import of it


def row_views(seq: Sequence) -> list[Sequence]:
    """`seq` as it stands at each of its logits rows: row j has its first j drafts in its output."""
    if not seq.drafts.token_ids:
        return [seq]
    return [seq] + [dataclasses.replace(seq, output_token_ids=seq.output_token_ids + seq.drafts.token_ids[:j])
                    for j in range(1, seq.logit_rows)]


class VerifyingSampler:
    """The engine's sampler with draft verification around it: a batch with no drafts goes straight through."""

    def __init__(self, sampler, speculation: Speculation | None):
        self.sampler = sampler
        self.speculation = speculation

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:  # logits [R, V]
        if not any(seq.drafts.token_ids for seq in seqs):
            return self.sampler(logits, seqs)                 # R == B; a failure is the caller's to split
        try:
            return self._verify(logits, seqs)
        except Exception:  # noqa: BLE001 - one sequence's rows at a time, as EngineCore does for one row each
            parts, first = [], 0
            for seq in seqs:
                try:
                    parts.append(self._verify(logits[first : first + seq.logit_rows], [seq]))
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    parts.append(SampleResult.failed(error_message(exc)))
                first += seq.logit_rows
            return SampleResult.concat(parts)

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:  # logits [R, V]
        """One token per sequence after its accepted drafts (`SampleResult.accepted`)."""
        rows = [view for seq in seqs for view in row_views(seq)]
        layout = RowLayout.of([seq.drafts.token_ids for seq in seqs])
        device = logits.device
        raw = logits.float()
        processed = self.sampler.process_on_device(raw, rows)
        draft_ids = torch.tensor(layout.draft_ids, dtype=torch.int64, device=device)          # [R]
        verdicts = greedy_verdicts(processed.logits, draft_ids)
        status = processed.status                                                             # [R]
        sampled = SampledRows.of(processed, rows)
        if sampled is not None:   # nothing above draws a random number: from here on, a failure is one row's alone
            verdicts = verdicts.overwritten(sampled.index, sampled_verdicts(
                sampled.probs, draft_ids[sampled.index], sampled.seeds, sampled.positions))
            status = sampled.flag_unusable(status)
        emission = emit(verdicts, verdicts.accepted & (status == DrawStatus.OK), draft_ids,
                        torch.tensor(layout.row_seq, dtype=torch.int64, device=device),
                        torch.tensor(layout.seq_starts, dtype=torch.int64, device=device))
        drawn = DeviceDraw(emission.tokens, status, processed.errors,
                           self.sampler.asked_logprobs(raw, processed, sampled, emission.tokens, rows))
        with step_result_transfer():
            result, emitted = drawn.to_host_beside(emission.emitted)
        return SampleResult.concat([self._accept(seq, result, emitted, first)
                                    for seq, first in zip(seqs, layout.seq_starts)])

    def _accept(self, seq: Sequence, rows: SampleResult, emitted: list[int], first: int) -> SampleResult:
        """One sequence's result from its rows (starting at `first`): the accepted drafts, then the emitted token."""
        drafts = seq.drafts.token_ids
        accepted = emitted[first : first + len(drafts) + 1].index(1)
        if drafts and self.speculation is not None:
            self.speculation.record(len(drafts), accepted)
        kept = [(drafts[j], rows.logprobs[first + j]) for j in range(accepted)]
        end = first + accepted
        return SampleResult([rows.token_ids[end]], [rows.logprobs[end]], [rows.errors[end]], [kept])


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
    if seq.drafts.token_ids:
        seq.drafts.token_ids = []
        if reason is None:
            block_manager.roll_back(seq)
    return emitted, logprobs, reason
