"""The MoE seam against the naive all-experts reference.

- Every dispatcher (local, all_to_all with and without send-once, allgather, DeepEP normal and
  low-latency) x every CPU expert-kernel family (torch, reference), through one `ModularMoE`; the
  Triton family runs the same cases in triton_kernel_cases.py (interpreter on CPU).
- The whole executor of a rank (placement -> replica choice -> dispatch -> experts -> combine ->
  attention-TP gather) on logical expert ids, with replicated experts and a rebalanced placement,
  on one rank and on two.
- Registration is explicit and the placement in force must match the weights held.
"""

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import MULTI_RANK_BACKENDS
from moe_seam_cases import LOCAL, check_seam_results, seam_on_rank

from moe_runtime.dispatch import naive_moe_reference
from moe_runtime.kernels import TopK, get_kernels
from moe_runtime.load_balancer import Placement
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.config.parallel_context import ParallelContext
from multirank import ranks  # noqa: F401  (fixture)

SEAM_SCENARIOS = ["uneven", "zero_tokens", "repeated_ranks", "masked"]
CPU_FAMILIES = ["torch", "reference"]

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 8, 6, 6, 3


@pytest.mark.parametrize("family", CPU_FAMILIES)
@pytest.mark.parametrize("backend", [LOCAL] + MULTI_RANK_BACKENDS)
def test_every_dispatcher_with_every_expert_kernel_matches_the_reference(ranks, backend, family):
    for scenario in SEAM_SCENARIOS:
        if backend == LOCAL:
            results = [seam_on_rank(LOCAL, scenario, family)]
        else:
            results = ranks(2).run(seam_on_rank, backend, scenario, family)
        check_seam_results(results, tolerance=1e-5)


# ------------------------------------------------------------------------ the executor of a rank
def expert_bank() -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H], w2 [E, H, I] of every logical expert."""
    gen = torch.Generator().manual_seed(7)
    return (0.3 * torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen),
            0.3 * torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen))


def logical_reference(x: torch.Tensor, topk: TopK) -> torch.Tensor:
    """Every logical expert on every token, weighted by the router's choice (float64)."""
    w13, w2 = expert_bank()

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = (rows.double() @ w13[e].double().t()).chunk(2, dim=1)
        return (torch.nn.functional.silu(gate) * up) @ w2[e].double().t()

    return naive_moe_reference(x.double(), topk.ids, topk.weights.double(), NUM_EXPERTS, expert)


def routed_tokens(seed: int, num_tokens: int) -> tuple[torch.Tensor, TopK]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, TOP_K, dtype=torch.long)
    return torch.randn(num_tokens, HIDDEN, generator=gen), TopK(torch.rand(num_tokens, TOP_K, generator=gen), ids)


def build_executor(parallel: ParallelContext, backend: str, redundant: int) -> tuple[MoEExecutor, ExpertWeights]:
    """One MoE layer registered the way a SparseMoE registers it, its weights taken from the bank."""
    executor = MoEExecutor(get_kernels("cpu", "torch"), parallel, backend=backend, num_redundant_experts=redundant,
                           hidden_size=HIDDEN, dtype=torch.float32, record_load=parallel.world_size > 1)
    experts = ExpertWeights(executor.local_expert_ids(NUM_EXPERTS), HIDDEN, INTERMEDIATE)
    w13, w2 = expert_bank()
    with torch.no_grad():
        experts.w13.copy_(w13[experts.expert_ids])
        experts.w2.copy_(w2[experts.expert_ids])
    assert executor.register_layer(experts, NUM_EXPERTS) == 0
    executor.finish_registration()
    return executor, experts


def move_to(placement: Placement, experts: ExpertWeights, rank: int) -> None:
    """Stage and commit this rank's slots of `placement` through the ExpertStore, as a migration does."""
    w13, w2 = expert_bank()
    for local, slot in enumerate(placement.geometry.rank_slots(rank)):
        expert = int(placement.phy2log[0, slot])
        experts.stage(local, expert, torch.cat([w13[expert].reshape(-1), w2[expert].reshape(-1)]).view(torch.uint8))
    experts.commit()


# 8 slots on 2 ranks: experts 0 and 3 replicated (on both ranks), the rest moved around
REBALANCED = torch.tensor([[3, 0, 5, 1, 0, 2, 4, 3]])


def _executor_on_rank(backend: str, attn_tp: int) -> dict:
    rank = dist.get_rank()
    parallel = ParallelContext(world_size=2, rank=rank, ep_size=2, ep_rank=rank, attn_tp_size=attn_tp,
                               attn_tp_rank=rank if attn_tp == 2 else 0)
    executor, experts = build_executor(parallel, backend, redundant=2)
    # attention TP: the worker's tokens are the same on both ranks; otherwise each rank has its own
    x, topk = routed_tokens(seed=0 if attn_tp == 2 else rank, num_tokens=7 if rank == 0 or attn_tp == 2 else 4)
    errors = [float((executor.run(0, x, topk).double() - logical_reference(x, topk)).abs().max())]
    new = Placement.from_phy2log(REBALANCED, NUM_EXPERTS, num_ranks=2)
    move_to(new, experts, rank)
    executor.set_placement(new)
    errors.append(float((executor.run(0, x, topk).double() - logical_reference(x, topk)).abs().max()))
    executor.end_step()
    counts = executor.recorder.snapshot(group=None).counts  # this rank's share of the routed ids
    return {"errors": errors, "recorded": int(counts.sum()), "routed": topk.ids.numel() * 2}


@pytest.mark.parametrize("attn_tp", [1, 2])
@pytest.mark.parametrize("backend", ["all_to_all", "allgather"])
def test_executor_on_two_ranks_matches_the_logical_reference_before_and_after_a_rebalance(ranks, backend, attn_tp):
    results = ranks(2).run(_executor_on_rank, backend, attn_tp)
    for rank, res in enumerate(results):
        assert max(res["errors"]) < 1e-5, f"rank {rank}: {res['errors']}"
    if attn_tp == 2:  # the worker's tokens are on both ranks: each dispatched (and recorded) its share only
        assert sum(res["recorded"] for res in results) == results[0]["routed"]
    else:
        assert [res["recorded"] for res in results] == [res["routed"] for res in results]


def test_one_rank_runs_the_same_seam_with_the_local_dispatcher():
    executor, _ = build_executor(ParallelContext.single("cpu"), "local", redundant=0)
    assert executor.recorder is None and not executor.needs_phase_agreement()
    for phase, tokens in (("prefill", 9), ("decode", 1), ("decode", 0)):
        executor.begin_step(phase)
        x, topk = routed_tokens(seed=tokens, num_tokens=tokens)
        torch.testing.assert_close(executor.run(0, x, topk).double(), logical_reference(x, topk), rtol=0, atol=1e-5)


def test_registration_is_explicit_and_ends_with_the_model():
    executor = MoEExecutor(get_kernels("cpu", "torch"), ParallelContext.single("cpu"), backend="local",
                           num_redundant_experts=0, hidden_size=HIDDEN, dtype=torch.float32, record_load=False)
    assert executor.local_expert_ids(NUM_EXPERTS) == executor.local_expert_ids(NUM_EXPERTS) == list(range(NUM_EXPERTS))
    assert executor.num_moe_layers == 0, "asking which experts a rank holds registers nothing"
    first = ExpertWeights(list(range(NUM_EXPERTS)), HIDDEN, INTERMEDIATE)
    assert [executor.register_layer(first, NUM_EXPERTS), executor.register_layer(first, NUM_EXPERTS)] == [0, 1]
    with pytest.raises(ValueError, match="disagree on the expert count"):
        executor.register_layer(first, NUM_EXPERTS + 1)
    executor.finish_registration()
    assert executor.placement.num_layers == 2
    with pytest.raises(RuntimeError, match="before finish_registration"):
        executor.register_layer(first, NUM_EXPERTS)


def test_a_placement_that_disagrees_with_the_weights_held_is_refused():
    executor, experts = build_executor(ParallelContext.single("cpu"), "local", redundant=0)
    swapped = Placement.from_phy2log(torch.tensor([[1, 0, 2, 3, 4, 5]]), NUM_EXPERTS, num_ranks=1)
    with pytest.raises(RuntimeError, match="slots hold experts"):
        executor.set_placement(swapped)   # the weights were not moved
    move_to(swapped, experts, rank=0)
    executor.set_placement(swapped)
    x, topk = routed_tokens(seed=3, num_tokens=5)
    torch.testing.assert_close(executor.run(0, x, topk).double(), logical_reference(x, topk), rtol=0, atol=1e-5)
