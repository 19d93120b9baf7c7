"""Routed experts through transformers' ExpertsInterface (`experts_implementation="moe_runtime"`).

transformers' experts classes decorated with `use_experts_implementation` hold every expert as fused 3D weights
and dispatch their forward to ALL_EXPERTS_FUNCTIONS[config._experts_implementation](module, hidden [T, H],
top_k_index [T, K], top_k_weights [T, K]); the router, the shared experts and the block around them stay
transformers' code. Registered under our name, the call goes to the `MoEExecutor` (placement, EP
dispatch/combine under DP attention, replicas, EPLB, our expert kernels) with this rank's `ExpertWeights`.

Each such module is bound at build time to an `ExpertsSeam` (its MoE layer index and our weights for the experts
this rank's slots hold), hung on it as a plain attribute. The module's own fused weights are loaded by
transformers (its conversion rules fuse per-expert checkpoint tensors), copied into ours by `take_weights` (only
the local experts; transposed or interleaved stacks put in our gate-rows-then-up-rows layout) and then dropped.

A module the seam cannot serve (no gate, a post-expert norm, an activation our kernels do not have) is not bound:
the function runs transformers' own `batched_mm` implementation for it, every rank holding all its experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.kernels import TopK
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.models.transformers_backend.step_context import StepContext

EXPERTS_IMPLEMENTATION = "moe_runtime"
SEAM_ATTRIBUTE = "moe_runtime_experts"


def register_experts() -> None:
    """Make "moe_runtime" an experts implementation transformers' experts modules dispatch to (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, executor_experts_forward)


def is_interface_experts(module: nn.Module) -> bool:
    """An experts module built by a `use_experts_implementation` class (its decorator sets these flags)."""
    return all(hasattr(module, flag) for flag in ("has_gate", "is_concatenated", "is_transposed", "has_bias"))


@dataclass(frozen=True)
class ExpertsShape:
    num_experts: int
    hidden_size: int
    intermediate_size: int


def experts_shape(module: nn.Module) -> ExpertsShape:
    """From the fused weights' shapes: gate_up_proj [E, 2I, H] (transposed: [E, H, 2I])."""
    gate_up = module.gate_up_proj
    if module.is_transposed:
        return ExpertsShape(gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] // 2)
    return ExpertsShape(gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2)


def seam_activation(module: nn.Module) -> ExpertActivation | str:
    """Our kernels' activation for this module, or why there is none. transformers' default gate is
    act_fn(gate) * up; gpt-oss's experts override `_apply_gate` with the clamped SwiGLU our kernels implement
    (`ExpertActivation.gpt_oss`, read from the module's alpha and limit): the one class-specific case."""
    from transformers.integrations.moe import _default_apply_gate

    if not module.has_gate:
        return "no gate projection (up_proj only)"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is _default_apply_gate:
        act = getattr(module, "act_fn", None)
        if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
            return ExpertActivation()
        return f"activation {type(act).__name__} (our expert kernels run SiLU-gated experts)"
    if type(module).__name__ == "GptOssExperts":
        return ExpertActivation.gpt_oss(alpha=module.alpha, limit=module.limit)
    return f"its own gate ({type(module).__name__}._apply_gate)"


@dataclass
class ExpertsSeam:
    """One transformers experts module bound to the executor: its MoE layer and this rank's weights."""

    executor: MoEExecutor
    moe_layer: int
    weights: ExpertWeights
    step: StepContext          # says whether this forward is an idle rank's stand-in
    num_experts: int           # logical experts of the layer

    def take_weights(self, module: nn.Module, reader) -> None:
        """Copy this rank's experts from the module's loaded fused weights into ours, then drop the module's. Under
        `--quantization int8 | fp8` each expert is quantized into our stacks as a native port's float checkpoint is
        (`ExpertWeights.fill`); `reader` names the checkpoint in a shape error."""
        rows = torch.tensor(self.weights.expert_ids, dtype=torch.long, device=module.gate_up_proj.device)
        gate_up = module.gate_up_proj.detach().index_select(0, rows)            # [E_local, 2I, H] or [.., H, 2I]
        down = module.down_proj.detach().index_select(0, rows)                  # [E_local, H, I] or [.., I, H]
        if module.is_transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        bias = module.gate_up_proj_bias.detach().index_select(0, rows) if module.has_bias else None   # [E_local, 2I]
        if not module.is_concatenated:   # gate and up interleaved along the output: gate rows first, then up
            gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
            bias = None if bias is None else torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        w = self.weights
        with torch.no_grad():
            if w.quant is not None:
                for local in range(len(w.expert_ids)):
                    w.fill(local, slice(None), gate_up[local], f"{module.__class__.__name__}.gate_up_proj", reader)
                    w.fill(local, None, down[local], f"{module.__class__.__name__}.down_proj", reader)
            else:
                w.w13.copy_(gate_up)
                w.w2.copy_(down)
            if bias is not None:
                w.b13.copy_(bias)
                w.b2.copy_(module.down_proj_bias.detach().index_select(0, rows))
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            param = getattr(module, name, None)
            if isinstance(param, nn.Parameter):   # all experts of every rank: no longer read
                setattr(module, name, nn.Parameter(w.w13.new_empty((0,)), requires_grad=False))


def executor_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:   # [T, H] -> [T, H]
    seam: ExpertsSeam | None = getattr(module, SEAM_ATTRIBUTE, None)
    if seam is None:   # a module the seam does not serve: transformers' own implementation
        from transformers.integrations.moe import batched_mm_experts_forward

        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    ids = top_k_index.long()                                                      # [T, K]
    # an id outside [0, E) is a "no expert" sentinel to transformers' own loops (skipped): weight 0 on expert 0
    outside = (ids < 0) | (ids >= seam.num_experts)
    topk = TopK(weights=top_k_weights.float().masked_fill(outside, 0.0), ids=ids.masked_fill(outside, 0))
    if seam.step.probe is not None:   # the KV shape probe (probe.py): nothing computed, no collective
        return torch.zeros_like(hidden_states)
    if seam.step.stand_in:   # an idle rank: the layer's collectives with no rows of its own
        seam.executor.run(seam.moe_layer, hidden_states[:0], TopK(topk.weights[:0], topk.ids[:0]))
        return torch.zeros_like(hidden_states)
    return seam.executor.run(seam.moe_layer, hidden_states, topk).to(hidden_states.dtype)
