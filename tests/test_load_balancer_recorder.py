import json

import pytest
import torch

from moe_runtime.load_balancer import (
                ExpertLoadRecorder,
                ExpertLoadTrace,
                balancedness,
                choose_replicas,
                load_trace,
                rebalance,
                save_trace,
            )
from moe_runtime.load_balancer.replica_choice import replica_table
from multirank import ranks  # noqa: F401  (fixture)


def run_steps(recorder, steps, layers, experts, placement, seed=0):
    """Record `steps` random steps; returns the per-step id lists for a plain recount."""
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        tokens = int(torch.randint(0, 7, (1,), generator=generator))  # includes empty steps
        per_layer = []
        for layer in range(layers):
            ids = torch.randint(0, experts, (tokens, 2), generator=generator)
            slots = choose_replicas(ids, replica_table(placement, layer, rank=step % 2, device="cpu"))
            recorder.record(layer, ids, slots)
            per_layer.append((ids.flatten().tolist(), slots.flatten().tolist()))
        recorder.end_step()
        history.append(per_layer)
    return history


def recount(history, layers, size, which, last=None):
    counts = [[0] * size for _ in range(layers)]
    for per_layer in history[-last:] if last else history:
        for layer, pair in enumerate(per_layer):
            for i in pair[which]:
                counts[layer][i] += 1
    return counts


@pytest.mark.parametrize("steps", [0, 2, 5, 13])
def test_window_and_totals_match_plain_recount(steps):
    layers, experts, slots, ranks, window = 3, 6, 8, 2, 4
    recorder = ExpertLoadRecorder(layers, experts, slots, ranks, window=window)
    history = run_steps(recorder, steps, layers, experts, recorder.placement)
    snap = recorder.snapshot()
    assert snap.steps == steps and snap.window == min(steps, window)
    expected_window = recount(history, layers, experts, 0, last=window) if steps else [[0] * experts] * layers
    assert snap.counts.tolist() == expected_window
    assert snap.totals.tolist() == (recount(history, layers, experts, 0) if steps else [[0] * experts] * layers)
    slot_window = recount(history, layers, slots, 1, last=window) if steps else [[0] * slots] * layers
    per_rank = [[sum(row[r * 4 : (r + 1) * 4]) for r in range(ranks)] for row in slot_window]
    assert snap.rank_load.tolist() == per_rank
    per_step_tokens = recorder.window_steps().sum(-1).tolist()  # [S, L], oldest first
    expected_steps = history[-window:] if steps else []
    assert per_step_tokens == [[len(pair[0]) for pair in per_layer] for per_layer in expected_steps]


def test_rank_load_without_slots_uses_even_split_of_placement():
    layers, experts, slots, ranks = 2, 4, 6, 3
    recorder = ExpertLoadRecorder(layers, experts, slots, ranks, window=8)
    load = torch.tensor([[40.0, 1.0, 1.0, 2.0], [5.0, 5.0, 30.0, 1.0]])
    placement = rebalance(load, slots, ranks)
    recorder.set_placement(placement)
    for layer in range(layers):
        ids = torch.repeat_interleave(torch.arange(experts), load[layer].long()).view(-1, 1)
        recorder.record(layer, ids)
    recorder.end_step()
    snap = recorder.snapshot()
    assert torch.allclose(snap.balancedness, balancedness(load, placement))
    assert torch.allclose(snap.max_over_mean * snap.balancedness, torch.ones(layers, dtype=torch.float64))
    encoded = json.dumps(snap.to_dict())
    assert json.loads(encoded)["placement"] == placement.phy2log.tolist()


def test_trace_round_trip(tmp_path):
    layers, experts = 2, 5
    recorder = ExpertLoadRecorder(layers, experts, 10, 2, window=3)
    run_steps(recorder, 7, layers, experts, recorder.placement, seed=4)
    path = tmp_path / "trace.json"
    save_trace(path, recorder)
    trace = load_trace(path)
    assert isinstance(trace, ExpertLoadTrace)
    assert torch.equal(trace.steps, recorder.window_steps())
    assert trace.steps.sum(0).tolist() == recorder.snapshot().counts.tolist()
    assert (trace.num_layers, trace.num_experts, trace.num_slots, trace.num_ranks) == (2, 5, 10, 2)


def test_trace_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        load_trace(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="other.json is not an expert-load trace"):
        load_trace(other)


def test_recorder_rejects_bad_window_and_placement():
    with pytest.raises(ValueError, match="window"):
        ExpertLoadRecorder(1, 4, 4, 2, window=0)
    recorder = ExpertLoadRecorder(1, 4, 4, 2)
    with pytest.raises(ValueError, match="placement.phy2log"):
        recorder.set_placement(rebalance(torch.ones(2, 4), 4, 2))


def _record_on_rank() -> list[list[int]]:
    """On each rank of the pool's gloo group: this rank's counts, then the snapshot summed over the group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    recorder = ExpertLoadRecorder(1, 4, 4, 2, window=2)
    recorder.record(0, torch.tensor([[rank, rank], [3, 3]]))  # rank r: expert r twice, expert 3 twice
    recorder.end_step()
    return recorder.snapshot(group=dist.group.WORLD).counts.tolist()


@pytest.mark.slow
def test_snapshot_sums_counts_over_a_process_group(ranks):
    """Two ranks of the session's shared gloo pool (multirank.py: started once, not per test): every rank's
    snapshot holds the counts of both."""
    assert ranks(2).run(_record_on_rank) == [[[2, 2, 0, 4]]] * 2
