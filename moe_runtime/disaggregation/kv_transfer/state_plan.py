"""Which prefill rank each decode rank pulls each linear-attention layer's recurrent state from (hybrid models).

A linear layer's state of one sequence is a fixed size, not blocks: its short convolution's last inputs
(channels [q heads | k heads | v heads] of this rank) and its delta-rule state (value heads x Dk x Dv). Under
attention TP a rank holds whole key heads and their value heads, with the matching channels. Re-sharding those
between two different head splits is not done: the two instances must split the linear layers' heads alike
(the same attention TP), which `plan_state_pulls` checks and refuses by name otherwise. Layers may still be
split differently (pipeline stages): each layer comes from a prefill rank that holds it, at the decode rank's
own place among that stage's attention-TP ranks (the handle lists a worker's ranks in rank order, which is
attention-TP order within a stage), so every decode rank pulls exactly its heads.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError, KVShard


@dataclass(frozen=True)
class StatePullSource:
    """Pull the request's states of `layers` (global indices, each a linear-attention layer) from `shard`'s server."""

    shard: KVShard
    layers: tuple[int, ...]


def plan_state_pulls(local: KVShard, remote: list[KVShard], tp_rank: int = 0) -> list[StatePullSource]:
    """The sources covering `local`'s linear layers, from `remote` (the prefilling worker's ranks, in rank order);
    `tp_rank` is the decode rank's attention-TP rank. Raises `KVLayoutError` naming what differs."""
    if not local.state_layers:
        return []
    by_shard: dict[int, list[int]] = {}
    for layer in local.state_layers:
        holders = [i for i, shard in enumerate(remote) if layer in shard.state_layers]
        if not holders:
            raise KVLayoutError(f"no prefill rank holds the recurrent state of linear-attention layer {layer} (the "
                                "prefill instance serves another model?)")
        mismatched = [remote[i] for i in holders if remote[i].state_shape_of(layer) != local.state_shape_of(layer)]
        if mismatched:
            raise KVLayoutError(
                f"recurrent-state transfer between different attention-TP splits is not supported: the prefill "
                f"instance holds {mismatched[0].state_heads} value heads of linear-attention layer {layer} per rank "
                f"(conv channels {mismatched[0].conv_channels}), this instance {local.state_heads} "
                f"({local.conv_channels}): run both with the same attention TP (ep / dp_attn, or --tp)")
        if len(holders) <= tp_rank:
            raise KVLayoutError(f"linear-attention layer {layer}: the prefill instance has {len(holders)} attention-TP "
                                f"ranks, this rank is attention-TP rank {tp_rank}")
        by_shard.setdefault(holders[tp_rank], []).append(layer)
    return [StatePullSource(remote[i], tuple(layers)) for i, layers in sorted(by_shard.items())]
