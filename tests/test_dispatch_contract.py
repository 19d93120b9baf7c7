"""Every dispatch backend against the naive oracle (every expert on every token, weighted sum).

Backends x expert-parallel sizes {2, 4} x routing scenarios, on gloo worker processes. The
expert side runs through `kernels.expert_mlp` / `kernels.masked_expert_mlp` (what the engine
calls); the oracle uses its own per-expert SwiGLU and shares no grouping code with either.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dispatch import (LAYOUT_CONTIGUOUS, LAYOUT_MASKED, DispatchConfig, make_dispatcher,
                      naive_moe_reference)
from dispatch.deepep_emulation import EmulatedDeepEPBuffer
from kernels import expert_mlp, masked_expert_mlp
from multirank import ranks  # noqa: F401  (fixture)

HIDDEN = 8
INTERMEDIATE = 6
TOP_K = 4
SLOTS_PER_RANK = 3      # < TOP_K: every token hits some rank more than once
MAX_TOKENS = 16         # bound for the low-latency backend, above every scenario's T
EXPERT_SEED = 1234

SCENARIOS = ["uneven", "zero_tokens", "all_empty", "zero_experts", "repeated_ranks", "masked"]
MULTI_RANK_BACKENDS = ["all_to_all", "all_to_all_no_dedup", "allgather", "deepep_normal",
                       "deepep_low_latency"]


@dataclasses.dataclass
class Case:
    x: torch.Tensor         # [T, H]
    slot_ids: torch.Tensor  # [T, K] int64
    weights: torch.Tensor   # [T, K] float32


@dataclasses.dataclass
class Experts:
    w13: torch.Tensor  # [num_slots, 2I, H]
    w2: torch.Tensor   # [num_slots, H, I]

    def oracle(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w13[slot].t()).chunk(2, dim=1)
        return (F.silu(gate) * up) @ self.w2[slot].t()


def make_experts(num_slots: int) -> Experts:
    gen = torch.Generator().manual_seed(EXPERT_SEED)
    return Experts(w13=0.3 * torch.randn(num_slots, 2 * INTERMEDIATE, HIDDEN, generator=gen),
                   w2=0.3 * torch.randn(num_slots, HIDDEN, INTERMEDIATE, generator=gen))


def _distinct_slots(num_tokens: int, choices: torch.Tensor, k: int, gen) -> torch.Tensor:
    rows = [choices[torch.randperm(choices.numel(), generator=gen)[:k]] for _ in range(num_tokens)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)


def make_case(scenario: str, world_size: int, rank: int) -> Case:
    """Deterministic inputs of `rank`; any rank can rebuild any other rank's case."""
    gen = torch.Generator().manual_seed(1000 * world_size + 10 * rank + SCENARIOS.index(scenario))
    num_slots = SLOTS_PER_RANK * world_size
    all_slots = torch.arange(num_slots)
    num_tokens = {"uneven": [5, 1, 9, 3][rank % 4],
                  "zero_tokens": 0 if rank % 2 else 6,
                  "all_empty": 0}.get(scenario, 7)
    if scenario == "zero_experts":
        # Only experts 0 and 1 of rank 0 are used: its expert 2 and every other rank's experts
        # receive nothing; the other top-k entries are masked.
        slots = torch.full((num_tokens, TOP_K), -1, dtype=torch.int64)
        slots[:, :2] = _distinct_slots(num_tokens, torch.tensor([0, 1]), 2, gen)
    elif scenario == "repeated_ranks":
        # All but one choice on one rank; token 0 even picks the same slot twice.
        home = torch.randint(0, world_size, (num_tokens,), generator=gen)
        slots = torch.empty(num_tokens, TOP_K, dtype=torch.int64)
        for t in range(num_tokens):
            on_home = torch.arange(SLOTS_PER_RANK) + int(home[t]) * SLOTS_PER_RANK
            slots[t, :SLOTS_PER_RANK] = on_home[torch.randperm(SLOTS_PER_RANK, generator=gen)]
            slots[t, SLOTS_PER_RANK:] = int(torch.randint(0, num_slots, (1,), generator=gen))
        if num_tokens:
            slots[0, 1] = slots[0, 0]
    else:
        slots = _distinct_slots(num_tokens, all_slots, TOP_K, gen)
        if scenario == "masked" and num_tokens:
            slots[torch.rand(slots.shape, generator=gen) < 0.3] = -1
            slots[0] = -1  # a token with no expert at all
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    return Case(x, slots, weights)


def _config(backend: str, world_size: int, rank: int, dtype=torch.float32) -> DispatchConfig:
    send_once = backend != "all_to_all_no_dedup"
    backend = "all_to_all" if backend == "all_to_all_no_dedup" else backend
    return DispatchConfig(backend, world_size, rank, group=None,
                          num_slots=SLOTS_PER_RANK * world_size, hidden_size=HIDDEN, dtype=dtype,
                          max_tokens_per_rank=MAX_TOKENS, send_once=send_once,
                          deepep_buffer_cls=EmulatedDeepEPBuffer)


def run_local_experts(out, layout: str, experts: Experts, rank: int) -> torch.Tensor:
    mine = slice(rank * SLOTS_PER_RANK, (rank + 1) * SLOTS_PER_RANK)
    w13, w2 = experts.w13[mine].to(out.recv_x.dtype), experts.w2[mine].to(out.recv_x.dtype)
    if layout == LAYOUT_MASKED:
        return masked_expert_mlp(out.recv_x, out.tokens_per_local_expert, w13, w2)
    return expert_mlp(out.recv_x, out.tokens_per_local_expert, w13, w2)


def expected_routing(scenario: str, world_size: int, rank: int):
    """Per local expert of `rank`: how many (token, k) pairs it gets and the sum of their rows."""
    counts = torch.zeros(SLOTS_PER_RANK, dtype=torch.int64)
    row_sums = torch.zeros(SLOTS_PER_RANK, HIDDEN, dtype=torch.float64)
    for source in range(world_size):
        case = make_case(scenario, world_size, source)
        for e in range(SLOTS_PER_RANK):
            hits = (case.slot_ids == rank * SLOTS_PER_RANK + e).sum(dim=1)   # [T]
            counts[e] += hits.sum()
            row_sums[e] += (hits.unsqueeze(1) * case.x.double()).sum(dim=0)
    return counts, row_sums


def _contract_on_rank(backend: str, scenario: str, dtype_name: str = "float32"):
    dtype = getattr(torch, dtype_name)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    case = make_case(scenario, world_size, rank)
    experts = make_experts(SLOTS_PER_RANK * world_size)
    dispatcher = make_dispatcher(_config(backend, world_size, rank, dtype))

    out = dispatcher.dispatch(case.x.to(dtype), case.slot_ids, case.weights)
    y = dispatcher.combine(run_local_experts(out, dispatcher.layout(), experts, rank), out.handle)

    reference = naive_moe_reference(case.x.double(), case.slot_ids, case.weights.double(),
                                     SLOTS_PER_RANK * world_size,
                                     lambda s, x: experts.oracle(s, x.float()).double())
    counts, row_sums = expected_routing(scenario, world_size, rank)
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
    }


def _check(results, tolerance):
    for rank, res in enumerate(results):
        where = f"rank {rank}"
        assert res["y_shape"] == res["x_shape"], where
        assert res["counts"] == res["expected_counts"], where
        assert res["counts_dtype"] == "torch.int64", where
        assert res["row_sum_err"] <= tolerance * 10, f"{where}: recv_x rows are not the routed tokens"
        assert res["max_err"] <= tolerance * max(1.0, res["ref_scale"]), \
            f"{where}: combine differs from the oracle by {res['max_err']}"


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", MULTI_RANK_BACKENDS)
def test_backend_matches_naive_oracle(ranks, backend, world_size, scenario):
    results = ranks(world_size).run(_contract_on_rank, backend, scenario)
    _check(results, tolerance=1e-5)
    expected_layout = LAYOUT_MASKED if backend == "deepep_low_latency" else LAYOUT_CONTIGUOUS
    assert {res["layout"] for res in results} == {expected_layout}


@pytest.mark.parametrize("backend", ["all_to_all", "allgather", "deepep_normal"])
def test_backend_in_bfloat16(ranks, backend):
    results = ranks(2).run(_contract_on_rank, backend, "uneven", "bfloat16")
    assert {res["y_dtype"] for res in results} == {"torch.bfloat16"}
    _check([{**res, "row_sum_err": 0.0} for res in results], tolerance=5e-2)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_local_backend_matches_naive_oracle(scenario):
    # One rank holding all slots of the two-rank cases.
    num_slots = 2 * SLOTS_PER_RANK
    case = make_case(scenario, world_size=2, rank=0)
    experts = make_experts(num_slots)
    dispatcher = make_dispatcher(DispatchConfig("auto", 1, 0, None, num_slots, HIDDEN,
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
