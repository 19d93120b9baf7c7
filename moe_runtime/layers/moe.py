"""The sparse MoE block: router -> top-k -> (placement, dispatch, experts, combine) -> + shared experts.

The block knows nothing of parallelism: an `executor` (chosen by the engine) turns logical
top-k choices into expert outputs, locally or across expert-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.skinny_matmul import linear_rows
from moe_runtime.checkpoint import CheckpointReader
from moe_runtime.layers.experts import DenseMLP, ExpertNaming, StackedExperts
from moe_runtime.layers.linear import Linear
from moe_runtime.weight_loading import copy_checked


@dataclass(frozen=True)
class MoEShape:
    hidden_size: int
    num_experts: int
    moe_intermediate_size: int
    shared_intermediate_size: int = 0      # 0 = no shared expert
    shared_expert_gate: bool = False       # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert
    shared_name: str = "shared_experts"    # checkpoint module name of the shared expert
    correction_bias: bool = False          # DeepSeek-V3 gate.e_score_correction_bias


class Router(nn.Module):
    """Router logits in fp32 (as transformers computes them for every MoE architecture here)."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool, dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False)
            if correction_bias else None
        )

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        copy_checked(self.weight, reader.read(f"{prefix}weight"), f"{prefix}weight", reader.directory)
        loaded = {"weight"}
        if self.e_score_correction_bias is not None:
            name = f"{prefix}e_score_correction_bias"
            copy_checked(self.e_score_correction_bias, reader.read(name), name, reader.directory)
            loaded.add("e_score_correction_bias")
        return loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] fp32
        return linear_rows(x.float(), self.weight.float())


class SparseMoE(nn.Module):
    def __init__(self, layer_index: int, shape: MoEShape, routing, executor, kernels,
                 naming: ExpertNaming = ExpertNaming(), dtype=torch.float32, device=None):
        super().__init__()
        self.layer_index = layer_index
        self.routing = routing
        self.gate = Router(shape.hidden_size, shape.num_experts, shape.correction_bias, dtype, device)
        self.experts = StackedExperts(
            executor.local_expert_ids(layer_index, shape.num_experts), shape.hidden_size,
            shape.moe_intermediate_size, naming, dtype, device,
        )
        self.shared_name = None
        if shape.shared_intermediate_size:
            self.shared_name = shape.shared_name
            self.add_module(shape.shared_name, DenseMLP(shape.hidden_size, shape.shared_intermediate_size, kernels, dtype, device))
        self.shared_expert_gate = Linear(shape.hidden_size, 1, False, dtype, device) if shape.shared_expert_gate else None
        self._executor = executor
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        logits = self.gate(x)                                                       # [T, E]
        topk = self._kernels.select_experts(logits, self.routing, self.gate.e_score_correction_bias)
        out = self._executor.run(self.layer_index, x, topk, self.experts)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
