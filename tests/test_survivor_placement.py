"""The placement survivors keep after losing ranks: every surviving slot unchanged, each expert no survivor holds
put into a reclaimed redundant slot (moe_runtime/load_balancer/survivor_placement.py), and the slot's weights reloaded from
the checkpoint as a fresh load would have them (ExpertWeights.reload_slot)."""
import pytest
import torch

from moe_runtime.load_balancer.placement import static_placement
from moe_runtime.load_balancer.survivor_placement import ExpertsLost, survivor_placement
from moe_runtime.moe.expert_weights import MIXTRAL_NAMING, ExpertWeights
from moe_runtime.weights.checkpoint import CheckpointReader


def _held_without(placement, lost_rank: int) -> torch.Tensor:
    per_rank = placement.slots_per_rank
    keep = [s for s in range(placement.num_slots) if s // per_rank != lost_rank]
    return placement.phy2log[:, keep]


def test_survivors_keep_their_slots_and_the_orphans_take_redundant_ones():
    # 8 experts on 4 ranks x 3 slots: rank 1 holds experts 3, 4, 5; 4 and 5 have no other replica
    previous = static_placement(2, 8, 12, 4)
    held = _held_without(previous, lost_rank=1)                 # [2, 9]
    result = survivor_placement(held, 8, 3)
    placement = result.placement
    assert placement.num_ranks == 3 and placement.num_slots == 9
    assert {(r.layer, r.expert) for r in result.reloads} == {(0, 4), (0, 5), (1, 4), (1, 5)}
    changed = (placement.phy2log != held).nonzero().tolist()
    assert sorted((layer, slot) for layer, slot in changed) == sorted((r.layer, r.slot) for r in result.reloads)
    assert bool((placement.logcnt >= 1).all())               # every expert has a slot again
    for reload in result.reloads:                                # a reclaimed slot held a replicated expert
        assert int(torch.bincount(held[reload.layer], minlength=8)[held[reload.layer, reload.slot]]) >= 2


def test_the_least_loaded_replicated_expert_gives_up_its_slot():
    previous = static_placement(1, 8, 12, 4)                    # experts 0..3 have two replicas
    held = _held_without(previous, lost_rank=1)
    load = torch.tensor([[9.0, 1.0, 9.0, 9.0, 0, 0, 0, 0]])     # expert 1 is the coolest replicated one
    result = survivor_placement(held, 8, 3, load=load)
    first = result.reloads[0]
    assert int(held[0, first.slot]) == 1


def test_survivors_that_cannot_hold_every_expert_are_refused_by_name():
    with pytest.raises(ExpertsLost, match="6 expert slots per MoE layer, fewer than the model's 8 experts"):
        survivor_placement(_held_without(static_placement(1, 8, 8, 4), lost_rank=0), 8, 3)


def test_a_reloaded_slot_equals_a_fresh_load(tiny_checkpoint_factory):
    checkpoint = tiny_checkpoint_factory("mixtral")
    reader = CheckpointReader.open(checkpoint)
    prefix = "model.layers.0.block_sparse_moe.experts."
    shape = dict(hidden_size=128, intermediate_size=reader.read(f"{prefix}0.w1.weight").shape[0])
    fresh = ExpertWeights([5, 6], naming=MIXTRAL_NAMING, **shape)
    fresh.load_weights(reader, prefix)
    reloaded = ExpertWeights([1, 2], naming=MIXTRAL_NAMING, **shape)
    reloaded.load_weights(reader, prefix)
    reloaded.reload_slot(0, 5)
    reloaded.reload_slot(1, 6)
    assert reloaded.expert_ids == [5, 6]
    assert torch.equal(reloaded.w13, fresh.w13) and torch.equal(reloaded.w2, fresh.w2)
