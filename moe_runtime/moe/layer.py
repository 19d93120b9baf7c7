"""The sparse MoE block: router -> top-k -> executor (placement, dispatch, experts, combine) -> + shared experts.

The block knows nothing of parallelism: it registers its routed experts with the `MoEExecutor`
when it is built, and hands its logical top-k choices to it in every step, on one rank or many.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.kernels import KernelSet, RoutingConfig, TopK
from moe_runtime.kernels.batch_invariant import BATCH_INVARIANT, invariant_sigmoid
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.layers.linear import Linear
from moe_runtime.moe.dense_mlp import DenseMLP
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.moe.expert_weights import ExpertNaming, ExpertWeights
from moe_runtime.moe.router import Router
from moe_runtime.moe.stages import Staged
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization, linear_quantization


@dataclass(frozen=True)
class MoEShape:
    hidden_size: int
    num_experts: int
    moe_intermediate_size: int
    shared_intermediate_size: int = 0      # 0 = no shared expert
    shared_expert_gate: bool = False       # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert
    shared_name: str = "shared_experts"    # checkpoint module name of the shared expert
    correction_bias: bool = False          # DeepSeek-V3 gate.e_score_correction_bias
    router_bias: bool = False              # gpt-oss router.bias
    expert_bias: bool = False              # gpt-oss gate_up_proj_bias / down_proj_bias
    activation: ExpertActivation = ExpertActivation()   # gpt-oss: ExpertActivation.gpt_oss(limit=swiglu_limit)
    router_name: str = "gate"              # checkpoint module name of the router (gpt-oss: "router")
    shared_activation: ExpertActivation = ExpertActivation()   # DeepSeek-V4 clamps its shared expert's too


class SparseMoE(nn.Module):
    def __init__(self, shape: MoEShape, routing: RoutingConfig, executor: MoEExecutor, kernels: KernelSet,
                 naming: ExpertNaming = ExpertNaming(), dtype=torch.float32, device=None,
                 quant: WeightQuantization | None = None):
        super().__init__()
        self.routing = routing
        self.router_name = shape.router_name
        self.add_module(shape.router_name, Router(shape.hidden_size, shape.num_experts, shape.correction_bias, dtype,
                                                  device, bias=shape.router_bias))
        self.experts = ExpertWeights(executor.local_expert_ids(shape.num_experts), shape.hidden_size,
                                     shape.moe_intermediate_size, naming, dtype, executor.routed_expert_device(device),
                                     quant,
                                     bias=shape.expert_bias, activation=shape.activation)
        self.moe_layer = executor.register_layer(self.experts, shape.num_experts)
        self.shared_name = None
        if shape.shared_intermediate_size:
            self.shared_name = shape.shared_name
            self.add_module(shape.shared_name, DenseMLP(shape.hidden_size, shape.shared_intermediate_size, kernels,
                                                        dtype, device, quant=linear_quantization(quant),
                                                        activation=shape.shared_activation))
        self.shared_expert_gate = Linear(shape.hidden_size, 1, False, dtype, device) if shape.shared_expert_gate else None
        self._executor = executor
        self._kernels = kernels
        # --deterministic: the gate's sigmoid in torch's vector body whatever the row count (kernels/batch_invariant.py)
        self._gate_sigmoid = invariant_sigmoid if kernels.name == BATCH_INVARIANT else torch.sigmoid

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """The block: one call for eager and captured steps. The shared experts run alongside the routed ones (on
        this thread while those compute on the host, --cpu-experts), and their output is added."""
        return self._executor.run(self.moe_layer, x, self._route(x), alongside=lambda: self._shared(x))

    def stages(self, x: torch.Tensor) -> Staged[torch.Tensor]:  # [T, H] -> [T, H]
        """`forward` for two-batch overlap, yielding while the routed experts' dispatch and combine are in flight
        (moe_runtime/moe/stages.py): the other micro-batch computes there."""
        return (yield from self._executor.stages(self.moe_layer, x, self._route(x),
                                                 alongside=lambda: self._shared(x)))

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:  # [T, H] -> [T, H], None without shared experts
        if self.shared_name is None:
            return None
        shared = getattr(self, self.shared_name)(x)
        if self.shared_expert_gate is not None:
            shared = self._gate_sigmoid(self.shared_expert_gate(x)) * shared
        return shared

    def _route(self, x: torch.Tensor) -> TopK:   # [T, H] -> top-k [T, K]
        router = getattr(self, self.router_name)
        logits = router(x)                                                          # [T, E]
        topk = self._kernels.select_experts(logits, self.routing, router.e_score_correction_bias)
        return self._replayed(logits, topk)

    def _replayed(self, logits: torch.Tensor, topk: TopK) -> TopK:   # logits [T, E] fp32, the layer's own choice
        """Routing replay: the rows a request forces take its ids, weighed by this layer's gating at them
        (moe/routing_record.py); every other row keeps `topk`."""
        replay = self._executor.routing
        return topk if replay is None else replay.force(self.moe_layer, logits, topk, self.routing)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:   # routed out [T, H] -> [T, H]
        shared = self._shared(x)
        return out if shared is None else out + shared
