"""Every dispatch backend against the naive oracle (every expert on every token, weighted sum).

Backends x expert-parallel sizes {2, 4} x routing scenarios, on gloo worker processes. The
expert side runs through `kernels.expert_mlp` / `kernels.masked_expert_mlp` (what the engine
calls); the oracle uses its own per-expert SwiGLU and shares no grouping code with either. The
cases live in dispatch_cases.py; test_moe_seam_contract.py runs them through the MoE seam
(dispatcher x expert kernel) for every kernel family.
"""

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import (HIDDEN, MULTI_RANK_BACKENDS, SCENARIOS, SLOTS_PER_RANK, Experts, dispatch_config,
                            make_case, make_experts, row_format)

from moe_runtime.dispatch import LAYOUT_CONTIGUOUS, LAYOUT_MASKED, DispatchConfig, make_dispatcher, naive_moe_reference
from moe_runtime.kernels import expert_mlp, masked_expert_mlp
from moe_runtime.load_balancer import SlotGeometry
from multirank import ranks  # noqa: F401  (fixture)


def run_local_experts(out, layout: str, experts: Experts, rank: int) -> torch.Tensor:
    mine = slice(rank * SLOTS_PER_RANK, (rank + 1) * SLOTS_PER_RANK)
    w13, w2 = experts.w13[mine].to(out.recv_x.dtype), experts.w2[mine].to(out.recv_x.dtype)
    if layout == LAYOUT_MASKED:
        return masked_expert_mlp(out.recv_x, out.tokens_per_local_expert, w13, w2)
    return expert_mlp(out.recv_x, out.tokens_per_local_expert, w13, w2)


def expected_routing(scenario: str, world_size: int, rank: int, hidden: int = HIDDEN):
    """Per local expert of `rank`: how many (token, k) pairs it gets and the sum of their rows."""
    counts = torch.zeros(SLOTS_PER_RANK, dtype=torch.int64)
    row_sums = torch.zeros(SLOTS_PER_RANK, hidden, dtype=torch.float64)
    for source in range(world_size):
        case = make_case(scenario, world_size, source, hidden)
        for e in range(SLOTS_PER_RANK):
            hits = (case.slot_ids == rank * SLOTS_PER_RANK + e).sum(dim=1)   # [T]
            counts[e] += hits.sum()
            row_sums[e] += (hits.unsqueeze(1) * case.x.double()).sum(dim=0)
    return counts, row_sums


def _contract_on_rank(backend: str, scenario: str, dtype_name: str = "float32"):
    rows = row_format(backend, getattr(torch, dtype_name))
    dtype = rows.dtype
    rank, world_size = dist.get_rank(), dist.get_world_size()
    case = make_case(scenario, world_size, rank, rows.hidden)
    experts = make_experts(SLOTS_PER_RANK * world_size, rows.hidden)
    dispatcher = make_dispatcher(dispatch_config(backend, world_size, rank, dtype))

    out = dispatcher.dispatch(case.x.to(dtype), case.slot_ids, case.weights)
    y = dispatcher.combine(run_local_experts(out, dispatcher.layout(), experts, rank), out.handle)

    reference = naive_moe_reference(case.x.double(), case.slot_ids, case.weights.double(),
                                     SLOTS_PER_RANK * world_size,
                                     lambda s, x: experts.oracle(s, x.float()).double())
    counts, row_sums = expected_routing(scenario, world_size, rank, rows.hidden)
    if dispatcher.layout() == LAYOUT_CONTIGUOUS:
        groups = out.recv_x.double().split(out.tokens_per_local_expert.tolist())
    else:
        groups = [out.recv_x[e, :c].double()
                  for e, c in enumerate(out.tokens_per_local_expert.tolist())]
    got_row_sums = torch.stack([g.sum(dim=0) for g in groups])
    return {
        "layout": dispatcher.layout(),
        "y_shape": tuple(y.shape), "y_dtype": str(y.dtype), "x_shape": tuple(case.x.shape),
        "max_err": float((y.double() - reference).abs().max()) if y.numel() else 0.0,
        "ref_scale": float(reference.abs().max()) if reference.numel() else 0.0,
        "counts": out.tokens_per_local_expert.tolist(),
        "counts_dtype": str(out.tokens_per_local_expert.dtype),
        "expected_counts": counts.tolist(),
        "row_sum_err": float((got_row_sums - row_sums).abs().max()),
        "tolerance": rows.tolerance,
    }


def _check(results):
    for rank, res in enumerate(results):
        tolerance = res["tolerance"]
        where = f"rank {rank}"
        assert res["y_shape"] == res["x_shape"], where
        assert res["counts"] == res["expected_counts"], where
        assert res["counts_dtype"] == "torch.int64", where
        assert res["row_sum_err"] <= 1e-4, f"{where}: recv_x rows are not the routed tokens"
        assert res["max_err"] <= tolerance * max(1.0, res["ref_scale"]), \
            f"{where}: combine differs from the oracle by {res['max_err']}"


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", MULTI_RANK_BACKENDS)
def test_backend_matches_naive_oracle(ranks, backend, world_size, scenario):
    results = ranks(world_size).run(_contract_on_rank, backend, scenario)
    _check(results)
    expected_layout = LAYOUT_MASKED if backend == "deepep_low_latency" else LAYOUT_CONTIGUOUS
    assert {res["layout"] for res in results} == {expected_layout}


@pytest.mark.parametrize("backend", ["all_to_all", "allgather", "deepep_normal"])
def test_backend_in_bfloat16(ranks, backend):
    results = ranks(2).run(_contract_on_rank, backend, "uneven", "bfloat16")
    assert {res["y_dtype"] for res in results} == {"torch.bfloat16"}
    _check(results)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_local_backend_matches_naive_oracle(scenario):
    # One rank holding all slots of the two-rank cases.
    num_slots = 2 * SLOTS_PER_RANK
    case = make_case(scenario, world_size=2, rank=0)
    experts = make_experts(num_slots)
    dispatcher = make_dispatcher(DispatchConfig("auto", SlotGeometry(num_slots, 1), 0, None, HIDDEN,
                                                torch.float32))
    assert dispatcher.layout() == LAYOUT_CONTIGUOUS
    out = dispatcher.dispatch(case.x, case.slot_ids, case.weights)
    y = dispatcher.combine(expert_mlp(out.recv_x, out.tokens_per_local_expert, experts.w13,
                                      experts.w2), out.handle)
    reference = naive_moe_reference(case.x, case.slot_ids, case.weights, num_slots,
                                    experts.oracle)
    valid = case.slot_ids[case.slot_ids >= 0]
    assert out.tokens_per_local_expert.tolist() == torch.bincount(valid, minlength=num_slots).tolist()
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
