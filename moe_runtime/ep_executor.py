"""Expert-parallel MoE execution on one rank: placement -> dispatch -> local experts -> combine.

Logical expert ids from the router become physical slots (replicas spread, a local replica
preferred), tokens travel to the ranks owning those slots, each rank runs its experts grouped,
and the weighted sum comes back. Inside a DP attention worker of several ranks (attention TP)
the worker's tokens are replicated on its ranks, so each rank dispatches only its share of them
and the shares are all-gathered afterwards.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from dispatch import LAYOUT_MASKED, DispatchConfig, make_dispatcher, select_backend
from load_balancer import ExpertLoadRecorder, Placement, choose_replicas, static_placement
from moe_runtime.parallel_context import ParallelContext

logger = logging.getLogger(__name__)

PHASES = ("prefill", "decode")


class ExpertParallelExecutor:
    def __init__(self, kernels, parallel: ParallelContext, *, backend: str, num_redundant_experts: int,
                 hidden_size: int, dtype: torch.dtype, record_window: int = 128, decode_max_tokens: int | None = None):
        self._kernels = kernels
        self.parallel = parallel
        self.backend = backend
        self.num_redundant_experts = num_redundant_experts
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.record_window = record_window
        self.decode_max_tokens = decode_max_tokens  # a decode step's tokens per rank (bounds DeepEP low-latency)
        self.moe_layers: dict[int, int] = {}      # decoder layer index -> MoE layer index
        self.num_experts: int | None = None
        self.placement: Placement | None = None
        self.recorder: ExpertLoadRecorder | None = None
        self._dispatchers: dict[str, object] = {}
        self.experts_by_layer: dict[int, object] = {}  # MoE layer index -> its StackedExperts
        self.phase = "prefill"
        self.comm_seconds = 0.0  # cumulative wall time in dispatch + combine

    @property
    def num_slots(self) -> int:
        return self.num_experts + self.num_redundant_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.parallel.ep_size

    def local_expert_ids(self, layer_index: int, num_experts: int) -> list[int]:
        """Called by each MoE block at construction: registers the layer, returns the experts it holds."""
        if self.num_experts not in (None, num_experts):
            raise ValueError(f"MoE layers disagree on the expert count ({self.num_experts} vs {num_experts})")
        self.num_experts = num_experts
        self.moe_layers[layer_index] = len(self.moe_layers)
        template = static_placement(1, num_experts, self.num_slots, self.parallel.ep_size).phy2log[0]  # [P]
        first = self.parallel.ep_rank * self.slots_per_rank
        return template[first : first + self.slots_per_rank].tolist()

    def finalize(self, model) -> None:
        """After the model is built: the placement over all MoE layers, the recorder, the dispatchers."""
        if not self.moe_layers:
            return
        for module in model.modules():
            if getattr(module, "layer_index", None) in self.moe_layers and hasattr(module, "experts"):
                self.experts_by_layer[self.moe_layers[module.layer_index]] = module.experts
        p = self.parallel
        placement = static_placement(len(self.moe_layers), self.num_experts, self.num_slots, p.ep_size)
        self.recorder = ExpertLoadRecorder(len(self.moe_layers), self.num_experts, self.num_slots, p.ep_size,
                                           window=self.record_window, device=p.device, placement=placement)
        self.set_placement(placement)
        for phase in PHASES:
            self._dispatchers[phase] = make_dispatcher(DispatchConfig(
                backend=self.backend, world_size=p.ep_size, rank=p.ep_rank, group=p.ep_group,
                num_slots=self.num_slots, hidden_size=self.hidden_size, dtype=self.dtype, device=p.device,
                phase=phase, max_tokens_per_rank=self.decode_max_tokens if phase == "decode" else None,
            ))

    def set_placement(self, placement: Placement) -> None:
        """Switch to a new placement (its expert weights already in place on every rank)."""
        self.placement = placement
        self._layer_placements = [placement.layer(m) for m in range(placement.num_layers)]  # cached: no per-step syncs
        self.recorder.set_placement(placement)

    def begin_step(self, phase: str) -> None:
        """Every rank must use the same backend in a step: the engine passes the agreed phase."""
        self.phase = phase

    def end_step(self) -> None:
        if self.recorder is not None:
            self.recorder.end_step()

    def needs_phase_agreement(self) -> bool:
        """True when prefill and decode steps use different backends (DeepEP normal vs low-latency)."""
        p = self.parallel
        chosen = {select_backend(self.backend, p.device, p.ep_size, phase) for phase in PHASES}
        return len(chosen) > 1

    def _token_share(self, num_tokens: int) -> tuple[int, int]:
        """Rows [start, stop) of the DP worker's tokens this attention-TP rank dispatches."""
        tp, r = self.parallel.attn_tp_size, self.parallel.attn_tp_rank
        per_rank = (num_tokens + tp - 1) // tp
        return min(r * per_rank, num_tokens), min((r + 1) * per_rank, num_tokens)

    def run(self, layer_index: int, x: torch.Tensor, topk, experts) -> torch.Tensor:  # [T, H] -> [T, H]
        moe_layer = self.moe_layers[layer_index]
        num_tokens = x.shape[0]
        start, stop = self._token_share(num_tokens)
        x_share, ids, weights = x[start:stop], topk.ids[start:stop], topk.weights[start:stop]
        slots = choose_replicas(ids, self._layer_placements[moe_layer], self.parallel.ep_rank, self.slots_per_rank)
        self.recorder.record(moe_layer, ids, slots)
        dispatcher = self._dispatchers[self.phase]
        started = time.perf_counter()
        out = dispatcher.dispatch(x_share, slots, weights)
        dispatched = time.perf_counter()
        if dispatcher.layout() == LAYOUT_MASKED:
            expert_out = self._kernels.masked_expert_mlp(out.recv_x, out.tokens_per_local_expert, experts.w13, experts.w2)
        else:
            expert_out = self._kernels.expert_mlp(out.recv_x, out.tokens_per_local_expert, experts.w13, experts.w2)
        computed = time.perf_counter()
        y_share = dispatcher.combine(expert_out, out.handle)                     # [stop - start, H]
        self.comm_seconds += (dispatched - started) + (time.perf_counter() - computed)
        if self.parallel.attn_tp_size == 1:
            return y_share
        return self._gather_shares(y_share, num_tokens)

    def _gather_shares(self, y_share: torch.Tensor, num_tokens: int) -> torch.Tensor:
        tp = self.parallel.attn_tp_size
        per_rank = (num_tokens + tp - 1) // tp
        padded = y_share.new_zeros(per_rank, y_share.shape[1])
        padded[: y_share.shape[0]] = y_share
        gathered = [torch.empty_like(padded) for _ in range(tp)]
        dist.all_gather(gathered, padded, group=self.parallel.attn_tp_group)
        return torch.cat(gathered, dim=0)[:num_tokens]
