"""Drafting with the checkpoint's multi-token-prediction layer (DeepSeek-V3 MTP, `models/deepseek_mtp.py`;
DeepSeek-V4's, `models/deepseek_v4_mtp.py`).

After every target step the MTP layer runs over the positions the step computed whose input tokens turned out
true (a prefill chunk's, a decode's, a verify step's up to its last accepted draft), each with the target's
hidden state there and the token after it, now known on the host: this fills the layer's own KV cache (one more
layer in the sequence's blocks, `LayerKVCache` like the target's) exactly as the model would have it. The
last such row of a sequence that sampled predicts the token after the one just emitted: draft 1. Draft j + 1
then comes from the layer run again at the next position on draft j and its own output (the chain), for up to
k drafts, as far as the sequence's blocks reach (a chain row writes the layer's cache there; the next step's
true rows overwrite it). Drafts are the layer's argmax: point masses for the verifier.

A layer that keeps per-sequence state (DeepSeek-V4's: its window's keys and its compressors' partial windows, in
rings indexed by position) reads and writes it at each sequence's state slot. Chain rows write the rings at
positions the next step's true rows write again, and the rings keep room for a verify step's tokens beyond the
window (`draft_slack`), so no position a later row reads is one a chain row left; an entry a chain row completed is
compressed again when its window really completes (as for the target's rejected drafts).

The drafts come back to the host in one copy per step ([D, k]), where the scheduler reads them next step
(`Sequence.drafts.proposed`); the MTP layer runs its MoE block through an executor of its own (its experts
spread over the expert-parallel ranks like the target's: `lock_step`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from moe_runtime.records.sequence import Sequence
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.execution.step_inputs import TargetHidden
from moe_runtime.layers.compressed_cache import LayerCompressedCache
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.moe.executor import MoEExecutor


class MtpModule(Protocol):
    """A checkpoint's MTP module (`models/deepseek_mtp.py`, `models/qwen3_next_mtp.py`), or an EAGLE-3 head
    (`models/eagle3.py`, whose first pass reads three of the target's hidden states through its `fc`)."""

    def kv_cache_spec(self) -> KVCacheSpec: ...

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor: ...   # the target's kept hidden rows -> [T, H]

    def predict(self, positions: torch.Tensor, token_ids: torch.Tensor, previous: torch.Tensor,
                batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor: ...   # [T], [T], [T, H] -> [T, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...                   # [B, H] -> [B, V] fp32


@dataclass
class MtpRows:
    """The MTP pass's rows for one target step (host lists): sequence b's rows are positions
    [starts[b], stops[b]) and the target's hidden rows `hidden_rows` for them, in order."""

    seqs: list[Sequence]           # [B] sequences with at least one row
    starts: list[int]              # [B]
    stops: list[int]               # [B]
    hidden_rows: list[int]         # [M]
    next_tokens: list[int]         # [M] the token after each row's position
    drafting: list[int]            # indices into seqs of those that sampled this step and go on

    @classmethod
    def of(cls, step: TargetHidden, sampled: set[str]) -> "MtpRows":
        rows = cls([], [], [], [], [], [])
        for seq, start, first_row, end_row in zip(step.seqs, step.starts, step.query_start, step.query_start[1:]):
            if seq.is_finished and not seq.parked:
                continue
            # true inputs end before the last known token: that one (the token just emitted) has no hidden state
            stop = min(start + end_row - first_row, seq.num_tokens - 1)
            if stop <= start:
                continue
            if seq.request_id in sampled:
                rows.drafting.append(len(rows.seqs))
            tokens = seq.all_token_ids
            rows.seqs.append(seq)
            rows.starts.append(start)
            rows.stops.append(stop)
            rows.hidden_rows.extend(range(first_row, first_row + stop - start))
            rows.next_tokens.extend(tokens[start + 1 : stop + 1])
        return rows


class MtpDrafter:
    def __init__(self, layer: MtpModule, executor: MoEExecutor | None, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, k: int, lock_step: bool = False,
                 cache: LayerCompressedCache | None = None, checkpoint_view: nn.Module | None = None):
        """`lock_step`: the layer exchanges with other ranks (the MoE block's experts, attention heads), so every
        rank runs the pass and all k - 1 chain rows every step, with no rows where it has none. `executor`: the
        layer's MoE block's (None: it has none, an EAGLE-3 head). `cache`: a layer keeping per-sequence state
        (DeepSeek-V4's) comes with its own, indexed by the sequences' state slots (None: one paged KV layer).
        `checkpoint_view`: the layer under the target checkpoint's names (an MTP layer: a weight update of the
        model loads its tensors too; None: its weights come from elsewhere, an EAGLE-3 head's own checkpoint)."""
        self.layer = layer
        self.checkpoint_view = checkpoint_view
        self.executor = executor
        self.lock_step = lock_step
        self.block_size = block_size
        self.device = device
        self.k = k
        self.cache = cache if cache is not None else LayerKVCache.allocate(layer.kv_cache_spec(), num_blocks,
                                                                             block_size, dtype, device, 0)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` drafts to follow `seq` (none: its last step drafted nothing for where it stands now)."""
        if seq.drafts.proposed_at != seq.num_tokens:
            return []
        return seq.drafts.proposed[:k]

    @torch.inference_mode()
    def after_step(self, step: TargetHidden | None, sampled: list[Sequence]) -> None:
        """Run the MTP layer over `step`'s true rows and draft for the sequences in `sampled` that go on."""
        if step is None:
            return
        rows = MtpRows.of(step, {seq.request_id for seq in sampled})
        if not rows.seqs and not self.lock_step:
            return
        dev = self.device
        batch = AttentionBatch.over_ranges([seq.kv.block_table for seq in rows.seqs], rows.starts, rows.stops,
                                           self.block_size, dev)
        batch.state_slots = [seq.kv.state_slot for seq in rows.seqs]
        positions = torch.tensor([p for start, stop in zip(rows.starts, rows.stops) for p in range(start, stop)],
                                 dtype=torch.long, device=dev)                                   # [M]
        previous = step.hidden.index_select(0, torch.tensor(rows.hidden_rows, dtype=torch.long, device=dev))
        if self.executor is not None:
            self.executor.begin_step("prefill")
        try:
            out = self.layer.predict(positions, torch.tensor(rows.next_tokens, dtype=torch.long, device=dev),
                                     self.layer.from_target(previous), batch, self.cache)       # [M, H]
            if rows.drafting or self.lock_step:
                self._forget_snapshots()
                self._chain(rows, out, batch.query_start)
        finally:
            if self.executor is not None:
                self.executor.end_step()

    def _forget_snapshots(self) -> None:
        """A state-keeping layer's prefix snapshots are of true rows only (the runner names them for the step, the
        pass over the true rows writes them): the chain's rows write none."""
        if isinstance(self.cache, LayerCompressedCache):
            self.cache.captures = {}

    def _chain(self, rows: MtpRows, out: torch.Tensor, query_start: list[int]) -> None:
        """Drafts 1..k of the drafting sequences from their last rows' outputs `out` [M, H]."""
        dev = self.device
        seqs = [rows.seqs[i] for i in rows.drafting]
        last_positions = [rows.stops[i] - 1 for i in rows.drafting]                            # [D]
        last_rows = torch.tensor([query_start[i + 1] - 1 for i in rows.drafting], dtype=torch.long, device=dev)
        hidden = out.index_select(0, last_rows)                                                 # [D, H]
        drafts = torch.full((len(seqs), self.k), -1, dtype=torch.long, device=dev)             # [D, k]
        token = self.layer.logits(hidden).argmax(dim=-1)                                        # [D]
        drafts[:, 0] = token
        alive = list(range(len(seqs)))                          # the sequences still chaining; hidden, token: theirs
        for j in range(1, self.k):
            # row j writes the layer's cache at last position + j: only where the sequence's blocks reach
            kept = [a for a, i in enumerate(alive)
                    if last_positions[i] + j < len(seqs[i].kv.block_table) * self.block_size]
            if not kept and not self.lock_step:
                break
            if len(kept) < len(alive):
                keep = torch.tensor(kept, dtype=torch.long, device=dev)
                hidden, token = hidden.index_select(0, keep), token.index_select(0, keep)
                alive = [alive[a] for a in kept]
            position = [last_positions[i] + j for i in alive]
            batch = AttentionBatch.over_ranges([seqs[i].kv.block_table for i in alive], position,
                                               [p + 1 for p in position], self.block_size, dev)
            batch.state_slots = [seqs[i].kv.state_slot for i in alive]
            hidden = self.layer.predict(torch.tensor(position, dtype=torch.long, device=dev), token, hidden, batch,
                                        self.cache)                                             # [A, H]
            token = self.layer.logits(hidden).argmax(dim=-1)                                    # [A]
            drafts[torch.tensor(alive, dtype=torch.long, device=dev), j] = token
        for seq, proposed in zip(seqs, drafts.tolist()):                                       # the one copy
            seq.drafts.proposed_at = seq.num_tokens
            seq.drafts.proposed = proposed[: proposed.index(-1)] if -1 in proposed else proposed
