"""Context parallelism: the ranks of a DP attention worker split each step's new tokens.

Every rank of the worker schedules the same step (one scheduler state per rank, kept in step as
with attention TP). `ContextParallel.plan` cuts it the same way on every rank:

- a sequence with at least 2 x cp new tokens (a prompt, or a chunk of one) is cut into 2 x cp
  near-equal pieces and rank r takes pieces r and 2cp-1-r (the "zigzag"): a piece late in the
  prompt attends to more keys than an early one, and each rank gets one of each, so causal
  attention costs about the same on every rank;
- a shorter sequence (a decode token, a small chunk) goes whole to the rank with the fewest tokens
  so far, so a decode batch is shared out by sequences.

Each rank embeds and runs its rows through every layer. In each attention layer the ranks
all-gather the new tokens' K/V (one collective per layer, keys and values in one buffer) and every
rank writes all of them into its own paged cache: the worker's cache is replicated on its cp ranks,
so a piece's queries attend to their whole context in one exact softmax, a decode token can run on
any rank, and the scheduler, prefix cache and chunked prefill see one cache as before. Why
all-gather into a replicated cache rather than ring passes with a log-sum-exp merge, and what it
costs, is in docs/design.md ("Context parallelism"). The MoE layers see each rank's rows only, so
expert dispatch is unchanged. After the last layer the ranks all-gather the hidden states: every
rank has the step's [T, H] output and samples the same tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moe_runtime.layers.attention_batch import AttentionBatch


@dataclass(frozen=True)
class SequencePiece:
    """New tokens [offset, offset + length) of step sequence `seq` (offsets count its new tokens)."""

    seq: int
    offset: int
    length: int


@dataclass
class ExchangeStats:
    """What the K/V exchanges moved: per rank, counted as received (the rows of the other cp ranks)."""

    exchanges: int = 0          # all-gathers of new K/V (one per attention layer per step)
    bytes_received: int = 0     # real rows only (padding excluded)
    seconds: float = 0.0        # wall time inside those all-gathers (waiting for a slower rank included)


def assign_pieces(query_lens: list[int], cp_size: int) -> list[list[SequencePiece]]:
    """Each rank's pieces of a step's sequences, in step order (see the module docstring)."""
    pieces: list[list[SequencePiece]] = [[] for _ in range(cp_size)]
    loads = [0] * cp_size
    for seq, length in enumerate(query_lens):
        if length >= 2 * cp_size:
            cuts = [length * i // (2 * cp_size) for i in range(2 * cp_size + 1)]
            for rank in range(cp_size):
                for part in (rank, 2 * cp_size - 1 - rank):
                    pieces[rank].append(SequencePiece(seq, cuts[part], cuts[part + 1] - cuts[part]))
                    loads[rank] += cuts[part + 1] - cuts[part]
        elif length > 0:
            rank = min(range(cp_size), key=lambda r: loads[r])
            pieces[rank].append(SequencePiece(seq, 0, length))
            loads[rank] += length
    for own in pieces:
        own.sort(key=lambda piece: (piece.seq, piece.offset))
    return pieces


@dataclass
class ContextSplit:
    """One step cut for this rank: its rows, their attention metadata, and how to put rows back together."""

    rows: torch.Tensor              # [t] int64: rows of the step this rank runs, ascending
    local_batch: AttentionBatch     # its pieces, each as a sequence (queries [end - length, end) of its context)
    slot_mapping: torch.Tensor      # [T] int64: the whole step's cache slots (every rank writes every new token)
    gather_index: torch.Tensor      # [T] int64: row of the padded all-gather holding each step row
    max_rows: int                   # rows of the rank with the most (all-gathers pad to it)
    rows_per_rank: list[int]
    group: Any
    stats: ExchangeStats

    @property
    def size(self) -> int:
        return len(self.rows_per_rank)

    def gather(self, local: torch.Tensor) -> torch.Tensor:  # [t, ...] -> [T, ...] in step order
        padded = local.new_zeros(self.max_rows, *local.shape[1:])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts).index_select(0, self.gather_index)

    def gather_kv(self, keys: torch.Tensor, values: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new K/V of the whole step from this rank's rows: keys [t, h, dk] (values [t, h, dv]) ->
        [T, h, dk] ([T, h, dv]), one all-gather for both."""
        rows = keys.shape[0]
        key_width = keys.shape[1:].numel()
        flat = keys.reshape(rows, key_width)
        if values is not None:
            flat = torch.cat([flat, values.reshape(rows, values.shape[1:].numel())], dim=1)    # [t, F]
        started = time.perf_counter()
        whole = self.gather(flat)                                                    # [T, F]
        self.stats.seconds += time.perf_counter() - started
        total = whole.shape[0]
        self.stats.exchanges += 1
        self.stats.bytes_received += (total - rows) * flat.shape[1] * flat.element_size()
        all_keys = whole[:, :key_width].reshape(total, *keys.shape[1:])
        if values is None:
            return all_keys, None
        return all_keys, whole[:, key_width:].reshape(total, *values.shape[1:])

    def write_kv(self, cache, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Store the whole step's new K/V (gathered from this rank's keys [t, h, dk]) in this rank's cache."""
        all_keys, all_values = self.gather_kv(keys, values)
        cache.write(self.slot_mapping, all_keys, all_values)


@dataclass
class ContextParallel:
    """This rank's place in its worker's context-parallel group; plans every step's split."""

    size: int
    rank: int
    group: Any
    stats: ExchangeStats = field(default_factory=ExchangeStats)

    def plan(self, batch: AttentionBatch) -> ContextSplit:
        pieces = assign_pieces(batch.query_lens, self.size)
        device = batch.slot_mapping.device
        rows_of_rank = [self._rows(batch, own, device) for own in pieces]           # [t_r] each, ascending
        rows_per_rank = [rows.numel() for rows in rows_of_rank]
        max_rows = max(rows_per_rank, default=0)
        # step row -> its row in the padded all-gather (rank r's rows start at r * max_rows)
        gather_index = torch.empty(batch.num_tokens, dtype=torch.long, device=device)
        for rank, rows in enumerate(rows_of_rank):
            gather_index[rows] = rank * max_rows + torch.arange(rows.numel(), device=device)
        rows = rows_of_rank[self.rank]
        split = ContextSplit(rows, self._local_batch(batch, pieces[self.rank], rows), batch.slot_mapping, gather_index,
                             max_rows, rows_per_rank, self.group, self.stats)
        split.local_batch.kv_writer = split
        return split

    @staticmethod
    def _rows(batch: AttentionBatch, pieces: list[SequencePiece], device) -> torch.Tensor:
        """[t] int64: the step rows of `pieces`, in order."""
        if not pieces:
            return torch.zeros(0, dtype=torch.long, device=device)
        starts = [batch.query_start[p.seq] + p.offset for p in pieces]
        return torch.cat([torch.arange(start, start + p.length, device=device) for start, p in zip(starts, pieces)])

    @staticmethod
    def _local_batch(batch: AttentionBatch, pieces: list[SequencePiece], rows: torch.Tensor) -> AttentionBatch:
        """This rank's pieces as a batch of their own: a piece of sequence b is a chunk whose context ends at
        its last token (the cache holds the tokens before it, and the step writes all new ones first)."""
        query_start = [0]
        context_lens = []
        for piece in pieces:
            first_new = batch.context_lens[piece.seq] - batch.query_lens[piece.seq]   # tokens cached before the step
            context_lens.append(first_new + piece.offset + piece.length)
            query_start.append(query_start[-1] + piece.length)
        device = batch.slot_mapping.device
        seqs = torch.tensor([piece.seq for piece in pieces], dtype=torch.long, device=device)
        return AttentionBatch(
            query_lens=[piece.length for piece in pieces], context_lens=context_lens, query_start=query_start,
            slot_mapping=batch.slot_mapping.index_select(0, rows),
            block_tables=batch.block_tables.index_select(0, seqs) if pieces else batch.block_tables[:0],
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_size=batch.block_size, source_seqs=[piece.seq for piece in pieces],
            prompt_lens=None if batch.prompt_lens is None else [batch.prompt_lens[piece.seq] for piece in pieces],
        )
