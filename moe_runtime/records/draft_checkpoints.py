"""Rolling recurrent states back past rejected drafts (linear-attention layers: Qwen3-Next's Gated DeltaNet).

A verify step computes a sequence's last token and its d drafts, L = 1 + d tokens, and leaves each linear
layer's state slot at the state after all of them. Rejected drafts must not stay in it, and unlike K/V a state
cannot be cut afterwards: so the step also writes the states after its first L - e tokens, e = 1..d (e
tokens too many), into checkpoint rows of its own (`LayerStateCache.captures`, the same mechanism as prefix
caching's snapshots: the convolution's inputs before that point, the delta rule's state run up to it). When e
drafts were rejected (`BlockManager.roll_back` records e on the sequence), the next step starts the slot from
checkpoint e, a device copy before its forward, as a cached prefix starts from its snapshot.

Each linear layer's state tensors keep the checkpoints after its slots, scratch row and snapshot pool: k rows
per slot (k = num_speculative_tokens), `DraftCheckpoints.row`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftCheckpoints:
    first_row: int         # the state row of slot 0's first checkpoint
    per_slot: int          # k: a verify step has at most k drafts, so at most k states to go back to

    def rows(self, num_slots: int) -> int:
        return num_slots * self.per_slot

    def row(self, slot: int, excess: int) -> int:
        """The row holding `slot`'s state with its step's last `excess` tokens (1..k) left out."""
        return self.first_row + slot * self.per_slot + excess - 1

    def captures(self, slot: int, drafts: int) -> list[tuple[int, int]]:
        """(tokens into the step, row) for a step of 1 + `drafts` tokens: the states rejection may go back to."""
        length = 1 + drafts
        return [(length - excess, self.row(slot, excess)) for excess in range(1, drafts + 1)]
