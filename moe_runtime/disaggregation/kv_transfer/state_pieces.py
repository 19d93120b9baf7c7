"""A decode rank's pulls of recurrent states (hybrid models' linear-attention layers): how they are cut and checked.

A request's state of one linear layer is a fixed size (`KVShard.bytes_per_state`); a pull asks one prefill rank
for the states of a few layers at once, at most `max_bytes` of them (a layer alone may exceed it: it is asked
alone). The reply carries two frames per layer, conv `[channels, width]` in the cache dtype and ssm
`[heads, Dk, Dv]` in float32; each frame's byte count is checked against the decode rank's own shapes before
anything is written (the plan already required both sides' shapes to be equal). A DeepSeek-V4 layer's state is
its own list of frames in the cache dtype (`KVShard.compressed_layers`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_runtime.disaggregation.kv_transfer.cache_io import from_frame
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.state_plan import StatePullSource


@dataclass(frozen=True)
class StatePiece:
    source: StatePullSource
    layers: tuple[int, ...]


def state_pieces_of(sources: list[StatePullSource], max_bytes: int) -> list[StatePiece]:
    """The pulls that fetch `sources`' states: per source, its layers in runs of at most `max_bytes`."""
    pieces = []
    for source in sources:
        step = max(1, max_bytes // max(source.shard.bytes_per_state(), 1))
        for first in range(0, len(source.layers), step):
            pieces.append(StatePiece(source, source.layers[first : first + step]))
    return pieces


def state_frame_shapes(shard: KVShard, layer: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the frames of one layer's state: conv inputs, then the delta-rule state (DeepSeek-V4: its
    window keys and carried projections, in the cache dtype)."""
    frames = shard.frames_of(layer)
    if frames is not None:
        return [(tuple(shape), shard.torch_dtype) for shape in frames.state]
    return [((shard.conv_channels, shard.conv_width), shard.torch_dtype),
            ((shard.state_heads, shard.state_key_dim, shard.state_value_dim), torch.float32)]


def parse_states(local: KVShard, piece: StatePiece, frames: list) -> tuple[list[list[torch.Tensor]], int]:
    """Per layer of `piece`, its state tensors over the received `frames`' bytes (no copy), and the bytes they carry.
    Raises ValueError when a frame count or size is not what `local`'s shapes say."""
    expected_frames = sum(len(state_frame_shapes(local, layer)) for layer in piece.layers)
    if len(frames) != expected_frames:
        raise ValueError(f"{len(frames)} frames, not {expected_frames}")
    layers, num_bytes, at = [], 0, 0
    for layer in piece.layers:
        parts = []
        for shape, dtype in state_frame_shapes(local, layer):
            frame = frames[at]
            at += 1
            expected = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            if frame.buffer.nbytes != expected:
                raise ValueError(f"{frame.buffer.nbytes} bytes, not {expected}")
            parts.append(from_frame(frame.buffer, dtype, shape))
            num_bytes += expected
        layers.append(parts)
    return layers, num_bytes
