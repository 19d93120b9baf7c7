"""MoE runtime kernels: routing, permute, grouped expert MLP, unpermute, RMSNorm, paged attention.

Each operation has a fast torch implementation (the CPU path), a naive `reference` oracle and a
Triton twin (imported lazily: importing this package never imports triton). Pick a family with
`get_kernels(device)`.
"""
from moe_runtime.folder_names import yield_bare_name

yield_bare_name(__name__, __file__)   # first: this folder is imported as moe_runtime.kernels only

# Absolute, so that they load moe_runtime.kernels even in the module yield_bare_name just replaced.
from moe_runtime.kernels.expert_mlp import expert_mlp, masked_expert_mlp  # noqa: E402
from moe_runtime.kernels.fused_moe import fused_moe  # noqa: E402
from moe_runtime.kernels.kernel_set import get_kernels  # noqa: E402
from moe_runtime.kernels.kernel_set_type import KernelSet  # noqa: E402
from moe_runtime.kernels.paged_attention import paged_decode_attention  # noqa: E402
from moe_runtime.kernels.permute import PermutePlan, permute_by_expert  # noqa: E402
from moe_runtime.kernels.rms_norm import NormOutput, fused_add_rms_norm, rms_norm  # noqa: E402
from moe_runtime.kernels.routing import RoutingConfig, TopK, select_experts  # noqa: E402
from moe_runtime.kernels.unpermute import unpermute_reduce  # noqa: E402

__all__ = [
    "KernelSet", "NormOutput", "PermutePlan", "RoutingConfig", "TopK",
    "expert_mlp", "fused_add_rms_norm", "fused_moe", "get_kernels", "masked_expert_mlp",
    "paged_decode_attention", "permute_by_expert", "rms_norm", "select_experts", "unpermute_reduce",
]
