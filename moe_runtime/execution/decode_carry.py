"""The carried decode batch: a captured decode step's inputs taken from the previous captured step's graph.

A steady decode batch (the same sequences, each computing the one token it sampled last) changes little from
one step to the next: every row's input id is the token the graph just drew, its position and context length one
more, its slot the next one of its table. The captured step (`DecodeCapture._decode_step`) computes those next
inputs itself, beside its logits and tokens; this record keeps them, already padded to the bucket, with the
step's block table and sampling parameters (penalty counts one token on: `GraphSampling.after_drawing`), and
hands them to the next step instead of the host building them again (`ModelRunner.prepare`, `DecodeCapture._pad`,
`GraphSampling.of`): vLLM's persistent batch, SGLang's carried decode state. The host still reads one token and
status per sequence per step.

The carry is taken only when the next step is provably the same batch one token on (`DecodeCarry.take`): the same
`Sequence` objects in the same order, each scheduling one token with no drafts, its cached tokens one more than
the kept step's, its newest token the one the graph drew (the engine accepted it), its parameters and seed the
same objects, no routing replay, and its block table the kept one with blocks appended at most. A row that gained
a block gets it written into the kept table (widened when the table is too narrow) and its slot computed on the
host (the graph could not know the block). Anything else, and every step the runner runs without a carry (an
eager, mixed, verify or host-sampled step), drops the kept state: the next step is prepared in full.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.graph_sampling import GraphSampling
from moe_runtime.sampling.params import SamplingParams


@dataclass
class PaddedStep:
    """A captured step's inputs padded to its bucket (`DecodeCapture._pad`), and its rows' sampling parameters."""

    input_ids: torch.Tensor        # [B] int64, pad rows 0
    positions: torch.Tensor        # [B] int64, pad rows 0
    slot_mapping: torch.Tensor     # [B] int64, pad rows the scratch slot
    block_tables: torch.Tensor     # [B, W] int32, -1 padded
    context_lens: torch.Tensor     # [B] int32, pad rows 0
    sampling: GraphSampling

    @property
    def bucket(self) -> int:
        return self.input_ids.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the graph takes: the forward's five, then the sampling parameters."""
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.context_lens,
                *self.sampling.tensors)

    def advanced(self, next_inputs: tuple[torch.Tensor, ...]) -> "PaddedStep":
        """The next step's inputs: the graph's (input ids, positions, slots, context lengths), this step's table
        and sampling parameters."""
        input_ids, positions, slot_mapping, context_lens = next_inputs
        return PaddedStep(input_ids, positions, slot_mapping, self.block_tables, context_lens, self.sampling)


@dataclass
class _KeptRow:
    """What the next step must find for one sequence to carry its row."""

    seq: Sequence
    cached: int                    # its cached tokens after the kept step: the next step's position
    token: int                     # the token the graph drew for it: the next step's input id
    table: list[int]               # its block table as the kept step's tensor holds it
    params: SamplingParams
    seed: int


@dataclass
class _Kept:
    rows: list[_KeptRow]
    step: PaddedStep               # the next step's inputs as the graph computed them


class DecodeCarry:
    """The previous captured step's next inputs, kept for one step (`keep`, then `take` or `drop`)."""

    def __init__(self, block_size: int, dynamic_width: bool):
        self.block_size = block_size
        self.dynamic_width = dynamic_width   # the table's width is a dynamic dimension of the graph (CPU)
        self._kept: _Kept | None = None

    def drop(self) -> None:
        self._kept = None

    def keep(self, seqs: list[Sequence], step: PaddedStep, tokens: list[int]) -> None:
        """After a captured step that drew `tokens` in its graph (and committed its tokens): `step` is the next
        step's inputs it computed. A row that drew no token (its draw failed) keeps nothing."""
        if len(tokens) != len(seqs) or any(token < 0 for token in tokens):
            self._kept = None
            return
        self._kept = _Kept([_KeptRow(seq, seq.num_cached_tokens, token, list(seq.kv.block_table), seq.params,
                                     seq.sampling_seed) for seq, token in zip(seqs, tokens)], step)

    def take(self, seqs: list[Sequence]) -> PaddedStep | None:
        """The kept next inputs when `seqs` is the kept batch one token on (module docstring), with any block a
        row gained written in; None otherwise. Either way the kept state is used up."""
        kept, self._kept = self._kept, None
        if kept is None or len(seqs) != len(kept.rows):
            return None
        grown: list[tuple[int, _KeptRow]] = []   # the rows that gained blocks since the kept step
        for index, (seq, row) in enumerate(zip(seqs, kept.rows)):
            if not self._same_row(seq, row):
                return None
            if len(seq.kv.block_table) != len(row.table):
                grown.append((index, row))
        kept.step.sampling.after_drawing([row.token for row in kept.rows], [row.params.penalized for row in kept.rows])
        return self._with_blocks(kept.step, grown) if grown else kept.step

    def _same_row(self, seq: Sequence, row: _KeptRow) -> bool:
        """`seq` computes, this step, the one token the kept step drew for `row`, through the same blocks (and
        perhaps new ones after them, one of which holds its position)."""
        table = seq.kv.block_table
        return (seq is row.seq and seq.num_scheduled_tokens == 1 and not seq.drafts.token_ids
                and seq.num_cached_tokens == row.cached and seq.num_tokens == row.cached + 1
                and bool(seq.output_token_ids) and seq.output_token_ids[-1] == row.token
                and seq.params is row.params and seq.sampling_seed == row.seed and seq.routing is None
                and len(table) >= len(row.table) and table[:len(row.table)] == row.table
                and row.cached // self.block_size < len(table))

    def _with_blocks(self, step: PaddedStep, grown: list[tuple[int, _KeptRow]]) -> PaddedStep:
        """`step` with the blocks the `grown` rows gained written into its table (widened when they pass its
        width, -1 padded like `DecodeCapture._pad`) and those rows' slots computed from their tables."""
        bs = self.block_size
        tables = step.block_tables                                                   # [B, W]
        widest = max(len(row.seq.kv.block_table) for _, row in grown)
        if widest > tables.shape[1]:
            tables = torch.nn.functional.pad(tables, (0, widest - tables.shape[1]), value=-1)
            if self.dynamic_width:
                torch._dynamo.mark_dynamic(tables, 1)
        slots = step.slot_mapping                                                    # [B]
        for index, row in grown:
            table, first, position = row.seq.kv.block_table, len(row.table), row.cached
            tables[index, first:len(table)] = torch.tensor(table[first:], dtype=torch.int32, device="cpu")
            slots[index] = table[position // bs] * bs + position % bs
        return PaddedStep(step.input_ids, step.positions, slots, tables, step.context_lens, step.sampling)
