"""Per-step attention metadata: which new tokens belong to which sequence, where their K/V go."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1] if self.query_start else 0

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (and there is at least one)."""
        return bool(self.query_lens) and all(n == 1 for n in self.query_lens)

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
