"""One linear-attention layer's recurrent state cache: fixed-size slots, one per running sequence.

A Gated DeltaNet layer keeps no K/V per token but, per sequence, the last K-1 inputs of its short
convolution (`conv` [slots, channels, K-1], the compute dtype) and its delta-rule state (`ssm` [slots, heads,
Dk, Dv], float32: the recurrence is rounding-sensitive over long contexts). Slots are handed out by the state
cache group (moe_runtime/kv_blocks/state_slots.py); the tensors are allocated once, so every slot keeps a fixed
address (what a captured step needs). The last slot is scratch, never handed out.

With prefix caching, rows after the scratch slot hold state snapshots at block boundaries of computed prefixes
(moe_runtime/kv_blocks/state_snapshots.py): a request resuming a cached prefix starts from a device copy of one
(`restore`), and a step writes those its scheduled tokens cross (`captures`, set by the runner each step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StateSpec:
    """What one linear layer keeps per sequence on this rank (its heads under attention TP)."""

    conv_channels: int
    conv_width: int       # the convolution's kernel size - 1: inputs kept from earlier tokens
    num_heads: int        # value heads
    key_dim: int
    value_dim: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_channels * self.conv_width * torch.tensor([], dtype=dtype).element_size()
        return conv + self.num_heads * self.key_dim * self.value_dim * 4


@dataclass
class LayerStateCache:
    conv: torch.Tensor      # [slots, channels, K-1]
    ssm: torch.Tensor       # [slots, heads, Dk, Dv] float32
    # this step's snapshots: slot -> [(tokens into the slot's sequence's step, snapshot row written after them)]
    captures: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def allocate(cls, spec: StateSpec, num_slots: int, dtype, device) -> "LayerStateCache":
        return cls(torch.zeros(num_slots, spec.conv_channels, spec.conv_width, dtype=dtype, device=device),
                   torch.zeros(num_slots, spec.num_heads, spec.key_dim, spec.value_dim, dtype=torch.float32,
                               device=device))

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

    def clear(self, slots: torch.Tensor) -> None:
        """Sequences starting from their first token begin from zero states."""
        self.conv.index_fill_(0, slots, 0)
        self.ssm.index_fill_(0, slots, 0)

    def restore(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Sequences resuming a cached prefix start from its snapshot rows (a copy on the device)."""
        self.conv.index_copy_(0, slots, self.conv.index_select(0, rows))
        self.ssm.index_copy_(0, slots, self.ssm.index_select(0, rows))

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """One sequence's states, conv [channels, K-1] and ssm [heads, Dk, Dv], copied to the CPU (a P/D transfer
        sends them as they are stored; moe_runtime/disaggregation/kv_transfer)."""
        return [self.conv[slot].contiguous().cpu(), self.ssm[slot].contiguous().cpu()]

    def write_slot(self, slot: int, parts: list[torch.Tensor]) -> None:
        """Store one sequence's states (`read_slot`'s pair, of this cache's shapes) into `slot`."""
        conv, ssm = parts
        if conv.shape != self.conv.shape[1:] or ssm.shape != self.ssm.shape[1:]:
            raise ValueError(f"states of shapes {tuple(conv.shape)}, {tuple(ssm.shape)} for a cache of "
                             f"{tuple(self.conv.shape[1:])}, {tuple(self.ssm.shape[1:])}")
        self.conv[slot].copy_(conv.to(device=self.conv.device, dtype=self.conv.dtype))
        self.ssm[slot].copy_(ssm.to(device=self.ssm.device, dtype=self.ssm.dtype))
