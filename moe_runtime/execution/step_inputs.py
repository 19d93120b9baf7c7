"""The flattened inputs of one forward step, as the model runner prepares them (and the captured
decode step replays them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.layers.attention_batch import AttentionBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    batch: AttentionBatch
    last_token_index: torch.Tensor  # [R] int64: rows whose logits are wanted: the last new token of each sequence
                                   # that samples this step (and, before it, its drafts' positions: `logit_rows`)


@dataclass
class TargetHidden:
    """A step's final hidden states, kept for a drafter that reads them (MTP; an EAGLE-3 head: the residual
    streams entering its aux layers, concatenated): row query_start[b] + j is sequence b's position starts[b] + j."""

    seqs: list                     # [B] the step's sequences, in order
    starts: list[int]              # [B] each one's first position this step
    query_start: list[int]         # [B + 1]
    hidden: torch.Tensor           # [T, H] after the final norm (EAGLE-3: [T, 3H])
