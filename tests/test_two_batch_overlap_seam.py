"""Two-batch overlap below the model: the micro-batch split, the interleaving, and the two-phase dispatch contract.

- `split_in_two` cuts a step by whole sequences, balanced by tokens, with each half's attention metadata.
- `interleave` alternates two staged computations at their yield points, the first leading.
- Every dispatcher x the torch expert kernel, two micro-batches interleaved through `ModularMoE.stages`
  (both transfers of a phase in flight at once, one micro-batch possibly empty) against the naive reference.
- `supports_async()` tells the truth: an async backend's start returns before a late peer joins the transfer,
  a synchronous one's does not; and the per-phase timeline counts a transfer hidden behind compute as hidden.
"""
import time

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import (HIDDEN, INTERMEDIATE, MULTI_RANK_BACKENDS, SLOTS_PER_RANK, dispatch_config, make_case,
                            make_experts, row_format)

import moe_runtime.dispatch.all_to_all
import moe_runtime.dispatch.allgather
from moe_runtime.dispatch import DispatchConfig, make_dispatcher, naive_moe_reference
from moe_runtime.dispatch.pending import Ready
from moe_runtime.kernels import get_kernels
from moe_runtime.load_balancer import SlotGeometry
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.models.micro_batches import balanced_split, split_in_two
from moe_runtime.moe.comm_timeline import CommTimeline
from moe_runtime.moe.expert_kernel import expert_kernel_for
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.moe.modular_moe import ModularMoE
from moe_runtime.moe.stages import YieldPoint, interleave, run_to_end
from multirank import ranks  # noqa: F401  (fixture)

DELAY_S = 0.4   # how late rank 1 joins a transfer in the asynchrony checks


# ------------------------------------------------------------------------------------------- the split
def attention_batch(query_lens: list[int], cached: list[int]) -> AttentionBatch:
    """A batch whose sequence b has cached[b] tokens in cache and query_lens[b] new ones; block b*4.. per sequence."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [b * 64 + p for b, (n, c) in enumerate(zip(query_lens, cached)) for p in range(c, c + n)]
    context = [n + c for n, c in zip(query_lens, cached)]
    return AttentionBatch(query_lens=list(query_lens), context_lens=context, query_start=starts,
                          slot_mapping=torch.tensor(slots, dtype=torch.long),
                          block_tables=torch.arange(4 * len(query_lens), dtype=torch.int32).view(-1, 4),
                          context_lens_tensor=torch.tensor(context, dtype=torch.int32), block_size=16)


@pytest.mark.parametrize("query_lens, expected_k", [
    ([1] * 6, 3),                 # decode: half the sequences each
    ([40, 8, 8, 8, 8], 1),        # one long prefill against the short ones
    ([1, 1, 30, 2], 2),           # decodes then a chunk
    ([50], 0),                    # one sequence: whole, never cut
    ([], 0),                      # an idle worker: two empty micro-batches
])
def test_split_is_by_whole_sequences_balanced_by_tokens(query_lens, expected_k):
    assert balanced_split(query_lens) == expected_k
    cached = [3 * b for b in range(len(query_lens))]
    batch = attention_batch(query_lens, cached)
    total = batch.num_tokens
    ids, positions = torch.arange(total) + 100, torch.arange(total) + 1000
    hidden = torch.randn(total, 4)
    first, second = split_in_two(ids, positions, batch, hidden)
    assert [first.batch.num_seqs, second.batch.num_seqs] == [expected_k, len(query_lens) - expected_k]
    assert torch.equal(torch.cat([first.input_ids, second.input_ids]), ids)
    assert torch.equal(torch.cat([first.positions, second.positions]), positions)
    assert torch.equal(torch.cat([first.hidden, second.hidden]), hidden)
    for micro, seqs in ((first, range(expected_k)), (second, range(expected_k, len(query_lens)))):
        seqs = list(seqs)
        assert micro.batch.query_lens == [query_lens[b] for b in seqs]
        assert micro.batch.context_lens == [batch.context_lens[b] for b in seqs]
        assert micro.batch.query_start[0] == 0 and micro.batch.num_tokens == micro.input_ids.shape[0]
        assert micro.batch.context_lens_tensor.tolist() == micro.batch.context_lens
        for i, b in enumerate(seqs):  # each sequence keeps its own cache slots and block table
            rows = slice(micro.batch.query_start[i], micro.batch.query_start[i + 1])
            assert torch.equal(micro.batch.slot_mapping[rows],
                               batch.slot_mapping[batch.query_start[b]:batch.query_start[b + 1]])
            assert torch.equal(micro.batch.block_tables[i], batch.block_tables[b])
            assert torch.equal(micro.batch.context_slots(i), batch.context_slots(b))
    assert split_in_two(ids, positions, batch, None)[1].hidden is None


# ------------------------------------------------------------------------------------------- the schedule
def test_interleave_alternates_at_yield_points_first_leading():
    log = []

    def staged(name: str, layers: int):
        for layer in range(layers):
            log.append(f"{name}{layer}:attn")
            yield YieldPoint.DISPATCH
            log.append(f"{name}{layer}:experts")
            yield YieldPoint.COMBINE
        log.append(f"{name}:done")
        return name.upper()

    assert interleave(staged("a", 2), staged("b", 2)) == ("A", "B")
    assert log == ["a0:attn", "b0:attn", "a0:experts", "b0:experts", "a1:attn", "b1:attn", "a1:experts",
                   "b1:experts", "a:done", "b:done"]
    log.clear()
    assert interleave(staged("a", 0), staged("b", 1)) == ("A", "B")   # one ends early: the other runs on alone
    assert log == ["a:done", "b0:attn", "b0:experts", "b:done"]
    log.clear()
    assert run_to_end(staged("c", 1)) == "C" and log == ["c0:attn", "c0:experts", "c:done"]


def test_ready_results_chain_and_report_done_at_once():
    done = []
    pending = Ready(3).then(lambda v: v * 2)
    pending.when_done(lambda: done.append(True))
    assert done == [True] and pending.wait() == 6 and pending.wait() == 6


# ------------------------------------------------------------------------------------------- two ranks
PAIRS = [("uneven", "zero_tokens"), ("masked", "all_empty"), ("repeated_ranks", "uneven")]


def _interleaved_micro_batches_on_rank(backend: str) -> dict:
    """Both micro-batches' errors against the reference, for every pair of PAIRS, and their tolerance. `backend` "local": one
    process holding every slot of the two-rank cases (no process group)."""
    rows = row_format(backend)
    if backend == "local":
        rank, world_size = 0, 2
        config = DispatchConfig("local", SlotGeometry(SLOTS_PER_RANK * world_size, 1), 0, None, HIDDEN)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        config = dispatch_config(backend, world_size, rank)
    dispatcher = make_dispatcher(config)
    seam = ModularMoE(dispatcher, expert_kernel_for(dispatcher.layout(), get_kernels("cpu", "torch")))
    bank = make_experts(config.slots.num_slots, rows.hidden)
    mine = list(config.slots.rank_slots(rank))
    experts = ExpertWeights(mine, rows.hidden, INTERMEDIATE, dtype=rows.dtype)
    with torch.no_grad():
        experts.w13.copy_(bank.w13[mine])
        experts.w2.copy_(bank.w2[mine])
    errors = []
    for first_scenario, second_scenario in PAIRS:
        # the second micro-batch's case is another rank's, so the two differ in token count and routing
        cases = [make_case(first_scenario, world_size, rank, rows.hidden),
                 make_case(second_scenario, world_size, 1 - rank, rows.hidden)]
        outputs = interleave(*(seam.stages(c.x.to(rows.dtype), c.slot_ids, c.weights, experts) for c in cases))
        for case, y in zip(cases, outputs):
            reference = naive_moe_reference(case.x.double(), case.slot_ids, case.weights.double(),
                                            config.slots.num_slots, lambda s, x: bank.oracle(s, x.float()).double())
            assert y.shape == case.x.shape
            scale = max(float(reference.abs().max()), 1.0) if y.numel() else 1.0
            errors.append(float((y.double() - reference).abs().max()) / scale if y.numel() else 0.0)
    return {"relative_errors": errors, "tolerance": rows.tolerance}   # DeepEP's rows are bf16


@pytest.mark.parametrize("backend", ["local"] + MULTI_RANK_BACKENDS)
def test_two_micro_batches_interleaved_through_every_dispatcher_match_the_reference(ranks, backend):
    results = [_interleaved_micro_batches_on_rank(backend)] if backend == "local" else \
        ranks(2).run(_interleaved_micro_batches_on_rank, backend)
    for rank, result in enumerate(results):
        assert max(result["relative_errors"]) < result["tolerance"], f"rank {rank}: {result}"


def test_the_local_dispatcher_says_it_cannot_overlap_and_hands_back_finished_transfers():
    dispatcher = make_dispatcher(DispatchConfig("local", SlotGeometry(4, 1), 0, None, HIDDEN))
    case = make_case("uneven", 2, 0)
    pending = dispatcher.dispatch_start(case.x, case.slot_ids.remainder(4), case.weights)
    done = []
    pending.when_done(lambda: done.append(True))
    assert not dispatcher.supports_async() and done == [True] and isinstance(pending, Ready)


def _late_peer_on_rank(backend: str) -> dict:
    """Rank 1 joins each transfer DELAY_S late; rank 0 times its starts and waits, and records a timeline."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dispatcher = make_dispatcher(dispatch_config(backend, world_size, rank))
    rows = row_format(backend)
    case = make_case("uneven", world_size, rank, rows.hidden)
    case.x = case.x.to(rows.dtype)
    # dispatch: only the payload is late (the counts exchange before it is synchronous by design)
    patched = {"all_to_all": (moe_runtime.dispatch.all_to_all, "start_all_to_all_rows"),
               "allgather": (moe_runtime.dispatch.allgather, "start_all_gather_rows")}.get(backend)
    original = getattr(*patched) if patched else None
    def late(*args, **kwargs):
        time.sleep(DELAY_S)
        return original(*args, **kwargs)

    if rank == 1 and patched:
        setattr(*patched, late)
    try:
        dist.barrier(group=None)
        started = time.perf_counter()
        pending = dispatcher.dispatch_start(case.x, case.slot_ids, case.weights)
        dispatch_start_s = time.perf_counter() - started
        out = pending.wait()
    finally:
        if patched:
            setattr(*patched, original)
    expert_out = torch.zeros_like(out.recv_x)   # the values do not matter here
    # combine: rank 1 starts it late; rank 0 "computes" for 2 x DELAY_S between its start and its wait
    timeline = CommTimeline()
    dist.barrier(group=None)
    if rank == 1:
        time.sleep(DELAY_S)
    started = time.perf_counter()
    pending = dispatcher.combine_start(expert_out, out.handle)
    times = timeline.started("combine", started, pending)
    combine_start_s = time.perf_counter() - started
    if rank == 0:
        time.sleep(2 * DELAY_S)
    times.wait_called = time.perf_counter()
    pending.wait()
    times.wait_returned = time.perf_counter()
    summary = timeline.summary()
    return {"async": dispatcher.supports_async(), "dispatch_start_s": dispatch_start_s,
            "combine_start_s": combine_start_s, "hidden_share": summary.hidden_share,
            "comm_s": summary.comm_seconds}


@pytest.mark.parametrize("backend", ["all_to_all", "allgather", "deepep_normal"])
def test_async_capability_matches_behaviour_and_the_timeline_counts_hidden_time(ranks, backend):
    result = ranks(2).run(_late_peer_on_rank, backend)[0]
    assert result["async"] == (backend != "deepep_normal")
    if result["async"]:
        assert result["dispatch_start_s"] < DELAY_S / 2, result   # returned with the payload still in flight
        assert result["combine_start_s"] < DELAY_S / 2, result
        # the combine completed about DELAY_S after its start, while rank 0 slept: hidden, not waited for
        assert result["comm_s"] > DELAY_S / 2 and result["hidden_share"] > 0.8, result
    else:
        assert result["combine_start_s"] > DELAY_S / 2, result   # the start waited for the late peer
        assert result["hidden_share"] == 0.0, result
