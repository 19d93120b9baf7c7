"""Routing replay on a rank: each forward's logical top-k ids recorded per position, and forced ids applied.

`StepRouting` is armed on the `MoEExecutor` for one forward of the model (the runner arms it only when a
sequence of that forward asked: `wants_routing`). Every MoE layer hands it its logical top-k ids before they
become physical slots (`record`), so replicas, placements and live migrations never show; with two-batch
overlap a layer runs once per micro-batch, in the micro-batches' order, and a per-layer cursor puts each
micro-batch's rows after the previous one's. A layer's router asks it for the forced choice of its rows
(`force`; DeepSeek-V4's hash layers too, the forced ids replacing their token-id table's): rows a request
forces take the forced ids, their weights the model's own gating evaluated at those ids
(`kernels.routing.chosen_weights`: the family's scores, normalization and scaling; DeepSeek's group-limited
choice and its correction bias play no part, as they play none in its weights).

`SequenceRouting` is one request's record: row p holds position p's ids at this stage's MoE layers, written
by every forward that computes p. A verify step's rejected drafts only write rows that a later forward
writes again before they are final; rows are handed to the front once final (engine/routing_replay.py), so
a preempted request's recompute does not change what was sent: a request's rows [0, prompt + generated - 1)
are those of the forwards that made its tokens, and the last sampled token, never fed through the model, has
none (SGLang's `seqlen - 1`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moe_runtime.kernels.routing import RoutingConfig, TopK, chosen_weights, expert_scores


@dataclass
class SequenceRouting:
    """One request's routing on this rank's MoE layers not handed out yet: `pending[p - sent]` for position p.
    Rows leave once final (`take`), so it holds a prefill chunk's or a verify step's rows, never the context's."""

    num_layers: int
    top_k: int
    record: bool                                  # return_routed_experts
    forced: np.ndarray | None = None              # [N, L_all, K] the ids to force at positions [0, N)
    layer_offset: int = 0                         # this stage's first MoE layer in the model's order
    sent: int = 0                                 # rows [0, sent) went to the front (final: never rewritten)
    pending: torch.Tensor = field(init=False)     # [n, L, K] int32 (CPU): positions [sent, sent + n)

    def __post_init__(self) -> None:
        self.pending = torch.zeros(0, self.num_layers, self.top_k, dtype=torch.int32)

    def write(self, start: int, rows: torch.Tensor) -> None:   # rows [n, L, K] for positions [start, start + n)
        """A forward's rows; those of positions already sent (a preempted request's recompute) are dropped."""
        skip = max(self.sent - start, 0)
        rows, start = rows[skip:], start + skip
        first, stop = start - self.sent, start - self.sent + rows.shape[0]
        if stop > self.pending.shape[0]:
            grown = torch.zeros(stop, self.num_layers, self.top_k, dtype=torch.int32)
            grown[: self.pending.shape[0]] = self.pending
            self.pending = grown
        self.pending[first:stop] = rows

    def take(self, final: int) -> torch.Tensor:   # [final - sent, L, K]
        """The rows of positions [sent, final), final now: handed out once."""
        count = max(final - self.sent, 0)
        if count > self.pending.shape[0]:
            raise RuntimeError(f"routing record: positions {self.sent}..{final - 1} are final, only "
                               f"{self.pending.shape[0]} of them were routed")
        taken, self.pending = self.pending[:count], self.pending[count:]
        self.sent += count
        return taken

    def forced_rows(self, start: int, count: int) -> tuple[np.ndarray, int] | None:
        """The forced ids of positions [start, start + count) on this stage's layers, and how many of them the
        forced array covers (None: none)."""
        if self.forced is None or start >= self.forced.shape[0]:
            return None
        stop = min(start + count, self.forced.shape[0])
        return self.forced[start:stop, self.layer_offset:self.layer_offset + self.num_layers], stop - start


class StepRouting:
    """One forward's routing, armed on the executor: the rows each layer routed, the rows it must force."""

    def __init__(self, num_rows: int, num_layers: int, top_k: int, device,
                 forced: torch.Tensor | None = None, forced_mask: torch.Tensor | None = None):
        self.num_rows = num_rows
        self.num_layers = num_layers
        self.forced = forced                   # [T, L, K] int64 on the device (rows outside the mask: 0)
        self.forced_mask = forced_mask         # [T] bool: rows whose ids are forced
        self._chunks: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._force_cursor = [0] * num_layers
        self.top_k = top_k
        self.device = device

    @classmethod
    def for_forward(cls, seqs: list, query_start: list[int], device) -> "StepRouting | None":
        """Armed when a sequence of this forward records or forces routing (its `routing`), else None."""
        asking = [seq.routing for seq in seqs if seq.routing is not None]
        if not asking:
            return None
        num_layers, top_k = asking[0].num_layers, asking[0].top_k
        num_rows = query_start[-1]
        forced = mask = None
        for index, seq in enumerate(seqs):
            if seq.routing is None:
                continue
            covered = seq.routing.forced_rows(seq.num_cached_tokens, seq.num_scheduled_tokens)
            if covered is None:
                continue
            if forced is None:
                forced = torch.zeros(num_rows, num_layers, top_k, dtype=torch.long)
                mask = torch.zeros(num_rows, dtype=torch.bool)
            ids, count = covered
            first = query_start[index]
            forced[first:first + count] = torch.from_numpy(ids.astype(np.int64))
            mask[first:first + count] = True
        if forced is not None:
            forced, mask = forced.to(device), mask.to(device)
        return cls(num_rows, num_layers, top_k, device, forced, mask)

    def record(self, moe_layer: int, ids: torch.Tensor) -> None:   # ids [t, K] logical
        if moe_layer < self.num_layers:   # a drafter's MoE layer (an MTP layer) registered after the model's
            self._chunks[moe_layer].append(ids)

    def force(self, moe_layer: int, logits: torch.Tensor, topk: TopK, config: RoutingConfig) -> TopK:
        """`topk` of the next rows of this layer ([t, K] of logits [t, E]) with the forced rows' ids replaced
        and their weights the model's gating at those ids."""
        if self.forced is None or moe_layer >= self.num_layers:
            return topk
        first = self._force_cursor[moe_layer]
        stop = first + logits.shape[0]
        self._force_cursor[moe_layer] = stop
        mask = self.forced_mask[first:stop]                                           # [t]
        ids = self.forced[first:stop, moe_layer]                                      # [t, K]
        forced_weights = chosen_weights(expert_scores(logits.float(), config.scoring), ids, config)   # [t, K]
        keep = mask.unsqueeze(-1)                                                     # [t, 1]
        return TopK(weights=torch.where(keep, forced_weights, topk.weights),
                    ids=torch.where(keep, ids, topk.ids.to(ids.dtype)))

    def taken(self) -> torch.Tensor:   # [T, L, K] int32 on the host
        """Every layer's rows of this forward, in the forward's row order."""
        layers = []
        for moe_layer, chunks in enumerate(self._chunks):
            rows = torch.cat(chunks) if chunks else torch.zeros(0, self.top_k, dtype=torch.long, device=self.device)
            if rows.shape[0] != self.num_rows:
                raise RuntimeError(f"routing record: MoE layer {moe_layer} routed {rows.shape[0]} rows of a "
                                   f"{self.num_rows}-row forward")
            layers.append(rows)
        if not layers:
            return torch.zeros(self.num_rows, 0, self.top_k, dtype=torch.int32)
        return torch.stack(layers, dim=1).to(device="cpu", dtype=torch.int32)

    def hand_out(self, seqs: list, query_start: list[int]) -> None:
        """Write each recording sequence's rows (positions from its `num_cached_tokens`: call before the
        forward's tokens are committed)."""
        if not any(seq.routing is not None and seq.routing.record for seq in seqs):
            return
        rows = self.taken()                                                           # [T, L, K]
        for index, seq in enumerate(seqs):
            if seq.routing is not None and seq.routing.record:
                seq.routing.write(seq.num_cached_tokens, rows[query_start[index]:query_start[index + 1]])
