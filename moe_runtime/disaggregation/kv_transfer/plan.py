"""Re-sharding: which prefill rank each decode rank pulls each (layer, KV heads) piece from.

The two instances may split heads differently (attention TP = ep / dp_attn, or tp) and layers
differently (pipeline stages). A decode rank needs, for each of its layers, its own heads; every
prefill rank of the worker that prefilled the request holds some (layer, heads) rectangle. The plan
covers the decode rank's rectangle with pieces of the prefill ranks', merged where the same source
serves consecutive layers with the same heads. Where several prefill ranks hold the same piece
(KV heads replicated over TP ranks, MLA's latent on every rank), decode ranks spread over them.
A hybrid model's linear-attention layers keep no blocks: they are planned apart (`state_plan`). A drafter's layer
(`KVShard.drafter`) comes only from a prefill rank that drafted with the same method; where none did, it is left
out (`draft_layer.py`: the decode side then drafts from rows never written, worse drafts, the same output).
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError, KVShard


@dataclass(frozen=True)
class PullSource:
    """Pull layers [first_layer, +num_layers) and heads [head_start, +num_heads) from `shard`'s server."""

    shard: KVShard
    first_layer: int
    num_layers: int
    head_start: int
    num_heads: int


def check_compatible(local: KVShard, remote: KVShard) -> None:
    if not (local.kv_layers and remote.kv_layers):
        return   # a pipeline stage of only linear-attention layers: no blocks to exchange with it
    for field in ("total_heads", "key_dim", "value_dim", "block_size"):
        if getattr(local, field) != getattr(remote, field):
            raise KVLayoutError(f"the prefill instance's KV cache has {field}={getattr(remote, field)}, this "
                                f"instance's {getattr(local, field)}: they must serve the same model with the same "
                                f"--block-size")


def plan_pulls(local: KVShard, remote: list[KVShard], spread: int = 0) -> list[PullSource]:
    """The pieces covering `local`'s layers x heads, from `remote` (the prefilling worker's ranks, in rank order).

    `spread` (the decode rank's attention-TP rank) picks among replicas, so decode ranks do not all
    pull from the first. Raises `KVLayoutError` when the shards cannot exchange blocks."""
    for shard in remote:
        check_compatible(local, shard)
    pieces: list[PullSource] = []
    for layer in local.kv_layers:
        drafting = layer == local.draft_layer
        if drafting and not any(shard.drafter == local.drafter and shard.draft_layer == layer for shard in remote):
            continue
        head, end = local.head_start, local.head_start + local.num_heads
        while head < end:
            # a drafter's layer only from a drafter's, a model layer only from a model layer
            holders = [shard for shard in remote
                       if shard.holds(layer, head) and drafting == (layer == shard.draft_layer)]
            if not holders:
                raise KVLayoutError(f"no prefill rank holds layer {layer}, KV head {head}")
            source = holders[spread % len(holders)]
            if source.dims_of(layer) != local.dims_of(layer):
                raise KVLayoutError(f"layer {layer} keeps tensors of {source.dims_of(layer)} channels on the prefill "
                                    f"instance, {local.dims_of(layer)} here: they must serve the same model")
            stop = min(end, source.head_start + source.num_heads)
            pieces.append(PullSource(source, layer, 1, head, stop - head))
            head = stop
    return merge_layers(pieces)


def merge_layers(pieces: list[PullSource]) -> list[PullSource]:
    """Join pieces of consecutive layers that come from the same source with the same heads."""
    merged: list[PullSource] = []
    for piece in pieces:
        for i, earlier in enumerate(merged):
            if (earlier.shard == piece.shard and earlier.head_start == piece.head_start
                    and earlier.num_heads == piece.num_heads
                    and earlier.first_layer + earlier.num_layers == piece.first_layer):
                merged[i] = PullSource(earlier.shard, earlier.first_layer, earlier.num_layers + 1, earlier.head_start,
                                       earlier.num_heads)
                break
        else:
            merged.append(piece)
    return merged
