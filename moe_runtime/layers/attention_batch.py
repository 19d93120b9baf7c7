"""Per-step attention metadata: which new tokens belong to which sequence, where their K/V go."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from moe_runtime.kernels.paged_prefill_attention import PagedPrefillBatch
from moe_runtime.layers.attention_span import AttentionSpan


class KVWriter(Protocol):
    """Stores a step's new K/V when a rank computes only some of its tokens (context parallelism)."""

    def write_kv(self, cache, keys: torch.Tensor, values: torch.Tensor | None = None) -> None: ...


@dataclass(frozen=True)
class SingleQuerySplit:
    """A batch split for attention: sequences with one new token (decodes, one-token chunks) attend through
    the paged decode kernel together; the others (prefills, chunks) through the varlen path.

    Under a windowed span (sliding, chunked) each one-token row reads from its own first key: its block table
    is shifted to start at that key's block (the kernel then reads no block before it, a windowed KV cache
    group's freed ones included) and `key_starts` / `context_lens` count from there."""

    single: list[int]               # batch indices of the one-token sequences
    multi: list[int]                # batch indices of the others
    single_rows: torch.Tensor       # [S] int64: token rows of the one-token sequences
    multi_rows: torch.Tensor        # [M] int64: token rows of the others, sequence by sequence
    block_tables: torch.Tensor      # [S, max_blocks] int32 of the one-token sequences
    context_lens: torch.Tensor      # [S] int32 of the one-token sequences
    key_starts: torch.Tensor | None = None   # [S] int32: each row's first key (windowed spans only)


@dataclass
class AttentionBatch:
    """A flattened batch of T new tokens from B sequences (varlen, no padding).

    Sequence b owns new tokens [query_start[b], query_start[b] + query_lens[b]); after this step
    its cache holds context_lens[b] tokens, the new ones being the last query_lens[b].
    """

    query_lens: list[int]          # [B]
    context_lens: list[int]        # [B]
    query_start: list[int]         # [B + 1]
    slot_mapping: torch.Tensor     # [T] int64: flat cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor     # [B, max_blocks] int32, -1 padded
    context_lens_tensor: torch.Tensor  # [B] int32
    block_size: int
    kv_writer: KVWriter | None = None  # context parallelism: gathers the other ranks' new K/V and stores all
    source_seqs: list[int] | None = None  # context parallelism: the step sequence each entry is a piece of
    # A captured decode step (moe_runtime/execution/decode_capture.py): every row is one sequence's single new token, the
    # tensors are padded to a bucket, and the Python lists are left empty (a capture must not depend on them).
    static_decode: bool = False
    # A model with windowed KV groups (moe_runtime/kv_blocks/kv_groups.py): group g's own slots and block tables, for
    # g = 1, 2, ... (this batch is group 0's); a layer picks its group's with `for_group`.
    group_views: list["AttentionBatch"] | None = None
    # A model with linear-attention layers (moe_runtime/kv_blocks/state_slots.py): each sequence's recurrent-state slot,
    # [B], the index its layers' state caches are read and written at.
    state_slots: list[int] | None = None
    # DeepSeek Sparse Attention (moe_runtime/layers/sparse_mla.py): the cache slots of the tokens an indexer layer
    # chose for each row this step, selecting layer -> [T, K] (-1: none), for the layers above that reuse them
    token_selections: dict = field(default_factory=dict, repr=False)
    # ... and each sequence's prompt length, [B]: a prompt token's top-k is taken over a row as wide as the prompt,
    # in whatever chunk it runs (`index_row_widths`); None: over the step's context (a drafter's own steps)
    prompt_lens: list[int] | None = None
    _splits: dict = field(default_factory=dict, repr=False)   # AttentionSpan -> SingleQuerySplit (per step)
    _prefills: dict = field(default_factory=dict, repr=False)  # seqs -> (rows, PagedPrefillBatch) (per step)

    @classmethod
    def over_ranges(cls, block_tables: list[list[int]], starts: list[int], stops: list[int], block_size: int,
                    device) -> "AttentionBatch":
        """Sequence b computes positions [starts[b], stops[b]) through its blocks `block_tables[b]`."""
        query_lens = [stop - start for start, stop in zip(starts, stops)]
        query_start = [0]
        for length in query_lens:
            query_start.append(query_start[-1] + length)
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, start, stop in zip(block_tables, starts, stops) for p in range(start, stop)]
        width = max((len(table) for table in block_tables), default=1) or 1
        padded = torch.full((len(block_tables), width), -1, dtype=torch.int32, device="cpu")   # host staging
        for i, table in enumerate(block_tables):
            padded[i, : len(table)] = torch.tensor(table, dtype=torch.int32, device="cpu")
        return cls(query_lens, list(stops), query_start, torch.tensor(slots, dtype=torch.long, device=device),
                   padded.to(device), torch.tensor(stops, dtype=torch.int32, device=device), block_size)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def for_group(self, group: int) -> "AttentionBatch":
        """The metadata a layer of KV cache group `group` reads and writes through (0: this batch)."""
        if group == 0:
            return self
        if self.group_views is None:
            raise RuntimeError(f"a layer of KV cache group {group} in a batch built with no windowed groups")
        return self.group_views[group - 1]

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1] if self.query_start else 0

    def split_single_queries(self, span: AttentionSpan | int | None = None) -> SingleQuerySplit:
        """Which sequences the paged decode kernel serves: every one with one new token; under a windowed
        `span` (an int: a sliding window) each from its own first key. Built once per step and span, shared by
        every layer of that span."""
        span = AttentionSpan.coerce(span)
        if span not in self._splits:
            single = [b for b in range(self.num_seqs) if self.query_lens[b] == 1]
            chosen = set(single)
            multi = [b for b in range(self.num_seqs) if b not in chosen]
            device = self.slot_mapping.device
            single_rows = torch.tensor([self.query_start[b] for b in single], dtype=torch.long, device=device)
            rows = [row for b in multi for row in range(self.query_start[b], self.query_start[b + 1])]
            multi_rows = torch.tensor(rows, dtype=torch.long, device=device)
            index = torch.tensor(single, dtype=torch.long, device=device)
            tables = self.block_tables.index_select(0, index)
            if span.windowed:
                self._splits[span] = self._windowed_split(span, single, multi, single_rows, multi_rows, tables)
            else:
                # the decode kernel attends to its table's whole width: cut to what these contexts need (known here)
                width = max(-(-max((self.context_lens[b] for b in single), default=1) // self.block_size), 1)
                self._splits[span] = SingleQuerySplit(single, multi, single_rows, multi_rows, tables[:, :width],
                                                      self.context_lens_tensor.index_select(0, index))
        return self._splits[span]

    def _windowed_split(self, span: AttentionSpan, single: list[int], multi: list[int], single_rows: torch.Tensor,
                        multi_rows: torch.Tensor, tables: torch.Tensor) -> SingleQuerySplit:
        """The one-token rows' tables shifted to their first key's block, as wide as the widest window needs:
        the decode kernel then reads each row's window and never what lies before (a long context's early
        blocks, or a windowed group's freed ones)."""
        bs = self.block_size
        starts = [span.first_needed(self.context_lens[b] - 1) for b in single]
        first_blocks = [start // bs for start in starts]
        ends = [-(-self.context_lens[b] // bs) for b in single]
        width = max(max((end - first for end, first in zip(ends, first_blocks)), default=1), 1)
        columns = [[min(first + j, max(end - 1, 0)) for j in range(width)] for first, end in zip(first_blocks, ends)]
        device = self.slot_mapping.device
        shifted = tables.gather(1, torch.tensor(columns, dtype=torch.long, device=device).view(len(single), width))
        lens = [self.context_lens[b] - first * bs for b, first in zip(single, first_blocks)]
        key_starts = [start - first * bs for start, first in zip(starts, first_blocks)]
        return SingleQuerySplit(single, multi, single_rows, multi_rows, shifted,
                                torch.tensor(lens, dtype=torch.int32, device=device),
                                torch.tensor(key_starts, dtype=torch.int32, device=device))

    def decode_key_starts(self, span: AttentionSpan) -> torch.Tensor:
        """[B] int32 first key of every row of a captured decode step (`static_decode`: each row one new token,
        the Python lists empty), computed on the device from the context lengths: no host read in the graph.
        Pad rows (context 0) get 0."""
        return span.first_needed_tensor(self.context_lens_tensor.long() - 1).to(torch.int32)

    def prefill_batch(self, seqs: list[int] | None = None) -> tuple[torch.Tensor | None, PagedPrefillBatch]:
        """The varlen prefill kernel's input for sequences `seqs` (default all): their token rows ([M] int64,
        None for all rows in order) and their cu_seqlens, block tables and context lengths. Built once per
        step and selection, shared by every layer."""
        key = None if seqs is None else tuple(seqs)
        if key not in self._prefills:
            chosen = range(self.num_seqs) if seqs is None else seqs
            device = self.slot_mapping.device
            rows = None
            tables = self.block_tables
            if seqs is not None:
                rows = torch.tensor([r for b in seqs for r in range(self.query_start[b], self.query_start[b + 1])],
                                    dtype=torch.long, device=device)
                tables = self.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device))
            self._prefills[key] = rows, PagedPrefillBatch.build(
                [self.query_lens[b] for b in chosen], [self.context_lens[b] for b in chosen], tables, self.block_size)
        return self._prefills[key]

    def write_kv(self, cache, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Store this step's new keys [T, h, dk] (and values) in `cache`; under context parallelism the
        other ranks' new tokens too, so every rank's cache holds the whole step."""
        if self.kv_writer is not None:
            self.kv_writer.write_kv(cache, keys, values)
        else:
            cache.write(self.slot_mapping, keys, values)

    def source_seq(self, seq: int) -> int:
        """The step sequence entry `seq` belongs to (itself, unless context parallelism cut it into pieces,
        which then share their cache context up to each piece's end)."""
        return seq if self.source_seqs is None else self.source_seqs[seq]

    def index_row_widths(self, seq: int) -> list[int] | None:
        """How many tokens wide each new token's top-k row of sequence `seq` is (DeepSeek Sparse Attention), as a
        one-step prefill and then decode steps (and transformers) score them: a prompt token's the whole prompt
        (the keys after it masked), a later token's its context up to itself. Tied index scores are common and
        torch.topk breaks ties by the whole row, so a prefill chunk's queries must see the prompt's width, not
        the chunk's context, to keep the same tokens (moe_runtime/layers/lightning_indexer.py). None: no prompt
        lengths known, each row as wide as the step's context."""
        if self.prompt_lens is None:
            return None
        context, prompt = self.context_lens[seq], self.prompt_lens[seq]
        return [max(prompt, position + 1) for position in range(context - self.query_lens[seq], context)]

    def context_slots(self, seq: int) -> torch.Tensor:
        """[context_lens[seq]] int64 flat cache slots of one sequence's whole context."""
        length = self.context_lens[seq]
        num_blocks = (length + self.block_size - 1) // self.block_size
        blocks = self.block_tables[seq, :num_blocks].long()
        offsets = torch.arange(self.block_size, device=blocks.device)
        return (blocks[:, None] * self.block_size + offsets[None, :]).reshape(-1)[:length]

    @classmethod
    def empty(cls, block_size: int, device) -> "AttentionBatch":
        return cls(
            query_lens=[], context_lens=[], query_start=[0],
            slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
            block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            context_lens_tensor=torch.zeros(0, dtype=torch.int32, device=device),
            block_size=block_size,
        )
