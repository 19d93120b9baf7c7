"""Splitting one step's flattened batch into the two micro-batches of two-batch overlap.

The split is by sequences, never inside one: attention needs a sequence's new tokens together
with their metadata (query and context lengths, block table), and a sequence cut in two would need
the first half's K/V written before the second half attends, an ordering the overlap schedule does
not give inside a layer. So micro-batch one holds sequences [0, k) and micro-batch two [k, B), with k
chosen to balance their token counts (a decode step: half the sequences each; a prefill of one long
prompt: everything in one, nothing in the other). The order is kept, so the two outputs concatenated
are the step's rows in order, and the earlier sequences (whose freshly written KV blocks a later
sequence of the same step may reuse through the prefix cache) are in the micro-batch that leads.

Either micro-batch may have 0 tokens (an idle DP worker's empty step gives two): it still runs every
layer, so every rank of the EP group starts the same collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from moe_runtime.layers.attention_batch import AttentionBatch


@dataclass
class MicroBatch:
    """A contiguous run of a step's sequences with their rows of the step's inputs."""

    input_ids: torch.Tensor        # [t] int64
    positions: torch.Tensor        # [t] int64
    batch: AttentionBatch          # the run's sequences only, token rows counted from 0
    hidden: torch.Tensor | None    # [t, H] the previous pipeline stage's activations (None on the first stage)
    # [t, len(aux_layers) * H] set by the run: the residual stream entering each of `CausalLM.aux_layers`
    # (an EAGLE-3 head reads them), concatenated in layer order; None when no layer is asked for
    aux_hidden: torch.Tensor | None = None


def balanced_split(query_lens: list[int]) -> int:
    """k such that sequences [0, k) and [k, B) hold token counts as equal as possible (the smallest such k)."""
    total = sum(query_lens)
    prefix = [0, *accumulate(query_lens)]                                    # [B + 1]
    return min(range(len(prefix)), key=lambda k: abs(2 * prefix[k] - total))


def sequence_run(batch: AttentionBatch, first: int, stop: int) -> AttentionBatch:
    """The attention metadata of sequences [first, stop) of `batch`, their token rows renumbered from 0."""
    row0, row1 = batch.query_start[first], batch.query_start[stop]
    return AttentionBatch(
        query_lens=batch.query_lens[first:stop],
        context_lens=batch.context_lens[first:stop],
        query_start=[start - row0 for start in batch.query_start[first:stop + 1]],
        slot_mapping=batch.slot_mapping[row0:row1],
        block_tables=batch.block_tables[first:stop],
        context_lens_tensor=batch.context_lens_tensor[first:stop],
        block_size=batch.block_size,
        group_views=None if batch.group_views is None else [sequence_run(v, first, stop) for v in batch.group_views],
        state_slots=None if batch.state_slots is None else batch.state_slots[first:stop],
        prompt_lens=None if batch.prompt_lens is None else batch.prompt_lens[first:stop],
    )


def split_in_two(input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 hidden: torch.Tensor | None) -> tuple[MicroBatch, MicroBatch]:
    """The step's inputs ([T] ids and positions, [T, H] activations or None) as two micro-batches of whole
    sequences, balanced by tokens; the first holds the earlier sequences."""
    k = balanced_split(batch.query_lens)
    cut = batch.query_start[k] if batch.query_start else 0

    def rows(first: int, stop: int, row0: int, row1: int) -> MicroBatch:
        return MicroBatch(input_ids[row0:row1], positions[row0:row1], sequence_run(batch, first, stop),
                          None if hidden is None else hidden[row0:row1])

    return rows(0, k, 0, cut), rows(k, batch.num_seqs, cut, batch.num_tokens)
