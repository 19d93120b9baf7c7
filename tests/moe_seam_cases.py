"""One case of the MoE seam on one rank: a dispatcher x an expert kernel (`ModularMoE`) against the
naive all-experts reference, on the routing cases of dispatch_cases.py.

Shared by test_moe_seam_contract.py (torch and reference kernels on CPU) and triton_kernel_cases.py
(Triton kernels: compiled on CUDA, or in the interpreter on CPU).
"""

import torch
import torch.distributed as dist
from dispatch_cases import (HIDDEN, INTERMEDIATE, SLOTS_PER_RANK, dispatch_config, make_case, make_experts,
                            row_format)

from moe_runtime.dispatch import DispatchConfig, make_dispatcher, naive_moe_reference
from moe_runtime.kernels import get_kernels
from moe_runtime.load_balancer import SlotGeometry
from moe_runtime.moe.expert_kernel import expert_kernel_for
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.moe.modular_moe import ModularMoE

LOCAL = "local"


def seam_on_rank(backend: str, scenario: str, family: str, dtype_name: str = "float32", device: str = "cpu") -> dict:
    """Run one case through the seam on this rank (`backend` "local": one rank holding every slot of the
    two-rank case, no process group needed); the result's error against the reference, and shapes."""
    dtype = getattr(torch, dtype_name)
    hidden = HIDDEN
    if backend == LOCAL:
        rank, case = 0, make_case(scenario, world_size=2, rank=0)
        geometry = SlotGeometry(2 * SLOTS_PER_RANK, 1)
        config = DispatchConfig(LOCAL, geometry, 0, None, HIDDEN, dtype, device)
    else:
        rows = row_format(backend, dtype)
        dtype, hidden = rows.dtype, rows.hidden
        rank, world_size = dist.get_rank(), dist.get_world_size()
        case = make_case(scenario, world_size, rank, hidden)
        config = dispatch_config(backend, world_size, rank, dtype, device)
        geometry = config.slots
    bank = make_experts(geometry.num_slots, hidden)
    dispatcher = make_dispatcher(config)
    seam = ModularMoE(dispatcher, expert_kernel_for(dispatcher.layout(), get_kernels(device, family)))
    mine = list(geometry.rank_slots(rank))
    experts = ExpertWeights(mine, hidden, INTERMEDIATE, dtype=dtype, device=device)
    with torch.no_grad():
        experts.w13.copy_(bank.w13[mine])
        experts.w2.copy_(bank.w2[mine])

    y = seam(case.x.to(device, dtype), case.slot_ids.to(device), case.weights.to(device), experts)

    reference = naive_moe_reference(case.x.to(dtype).double(), case.slot_ids, case.weights.double(), geometry.num_slots,
                                    lambda slot, x: bank.oracle(slot, x.float()).double())
    return {
        "kernel_layout": seam.kernel.layout, "dispatch_layout": dispatcher.layout(),
        "y_shape": tuple(y.shape), "x_shape": tuple(case.x.shape), "y_dtype": str(y.dtype),
        "max_err": float((y.double().cpu() - reference).abs().max()) if y.numel() else 0.0,
        "ref_scale": float(reference.abs().max()) if reference.numel() else 0.0,
        "dtype": str(dtype).removeprefix("torch."),     # DeepEP's rows are bf16 whatever was asked
    }


def check_seam_results(results: list[dict], tolerance: float) -> None:
    """`tolerance` of float32 results; bf16 ones (DeepEP's rows) are held to bf16's."""
    for rank, res in enumerate(results):
        where = f"rank {rank}"
        if res["dtype"] == "bfloat16":
            tolerance = max(tolerance, 5e-2)
        assert res["kernel_layout"] == res["dispatch_layout"], where
        assert res["y_shape"] == res["x_shape"], where
        assert res["max_err"] <= tolerance * max(1.0, res["ref_scale"]), \
            f"{where}: the seam differs from the all-experts reference by {res['max_err']}"
