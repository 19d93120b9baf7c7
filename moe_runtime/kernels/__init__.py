"""MoE runtime kernels: routing, permute, grouped expert MLP, unpermute, RMSNorm, paged attention.

Each operation has a fast torch implementation (the CPU path), a naive `reference` oracle and a
Triton twin (imported lazily: importing this package never imports triton). Pick a family with
`get_kernels(device)`.
"""

from moe_runtime.kernels.expert_mlp import expert_mlp, masked_expert_mlp
from moe_runtime.kernels.fused_moe import fused_moe
from moe_runtime.kernels.kernel_set import get_kernels
from moe_runtime.kernels.kernel_set_type import KernelSet
from moe_runtime.kernels.paged_attention import paged_decode_attention
from moe_runtime.kernels.permute import PermutePlan, permute_by_expert
from moe_runtime.kernels.rms_norm import NormOutput, fused_add_rms_norm, rms_norm
from moe_runtime.kernels.routing import RoutingConfig, TopK, select_experts
from moe_runtime.kernels.unpermute import unpermute_reduce

__all__ = [
    "KernelSet", "NormOutput", "PermutePlan", "RoutingConfig", "TopK",
    "expert_mlp", "fused_add_rms_norm", "fused_moe", "get_kernels", "masked_expert_mlp",
    "paged_decode_attention", "permute_by_expert", "rms_norm", "select_experts", "unpermute_reduce",
]
