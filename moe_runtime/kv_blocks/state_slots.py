"""The state cache group: one fixed-size recurrent-state slot per running sequence, for models whose linear-attention
layers (Qwen3-Next's and Qwen3.5-MoE's Gated DeltaNet) keep a state instead of per-token K/V.

A sequence takes a slot when admitted and gives it back when it finishes or is preempted; its slot index is the
same in every linear layer (each layer's `LayerStateCache`, moe_runtime/layers/state_cache.py, is a preallocated
[slots + 1, ...] tensor, so addresses never move). A sequence whose first token is scheduled starts from zero
states (the runner clears its slot), so a preempted request's recompute rebuilds them from its tokens, and a
prefill cut into chunks continues from the state its previous chunk left.

There are `max_num_seqs` slots: the scheduler never runs more sequences than that, so the full group's blocks
alone decide admission. With prefix caching a cached prefix resumes from a state snapshot at its last block
boundary (moe_runtime/kv_blocks/state_snapshots.py), copied into the slot instead of the zeros.
"""
from __future__ import annotations

from collections import deque

LINEAR_ATTENTION = "linear_attention"   # transformers' layer_types entry of a Gated DeltaNet layer
# every layer_types entry whose layer keeps a recurrent state: linear attention (also Mamba, Mamba2, lightning),
# LFM2's short convolutions ("conv"), and attention layers with a state beside (ZAYA, Inkling: "hybrid",
# "hybrid_sliding"), served by the transformers backend (models/transformers_backend/recurrent_*)
RECURRENT_LAYER_TYPES = (LINEAR_ATTENTION, "conv", "hybrid", "hybrid_sliding")


def linear_attention_layers(hf_config) -> tuple[int, ...]:
    """The model's layers that keep a recurrent state (none for a model without layer_types)."""
    layer_types = getattr(hf_config, "layer_types", None) or ()
    return tuple(i for i, kind in enumerate(layer_types) if kind in RECURRENT_LAYER_TYPES)


def state_layers(hf_config) -> tuple[int, ...]:
    """The layers that keep per-sequence state in a slot: linear-attention layers, and every DeepSeek-V4 layer (its
    sliding window's keys and its compressors' partial windows: moe_runtime/layers/compressed_cache.py)."""
    if getattr(hf_config, "model_type", None) == "deepseek_v4":
        return tuple(range(hf_config.num_hidden_layers))
    return linear_attention_layers(hf_config)


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a state cache group needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} recurrent-state slots are held")
        return self._free.popleft()

    def release(self, slot: int) -> None:
        self._free.append(slot)
