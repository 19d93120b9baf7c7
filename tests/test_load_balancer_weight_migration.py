"""Weight migration moves experts through each layer's ExpertStore: read a slot, stage, commit or discard.

The store here is the runtime's own (`ExpertWeights`); the migration never writes a parameter itself,
and nothing it staged is in force before commit.
"""

import pytest
import torch
import torch.distributed as dist

from moe_runtime.load_balancer import Placement, plan_migration, static_placement
from moe_runtime.load_balancer.weight_migration import migrate_layer
from moe_runtime.moe.expert_weights import ExpertWeights
from multirank import ranks  # noqa: F401  (fixture)

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 4, 3, 6


def expert_weights(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [2I, H], w2 [H, I] of a logical expert: filled with its id, so a slot's content names it."""
    return (torch.full((2 * INTERMEDIATE, HIDDEN), float(expert)),
            torch.full((HIDDEN, INTERMEDIATE), float(expert) + 0.5))


def store_holding(expert_ids: list[int]) -> ExpertWeights:
    store = ExpertWeights(expert_ids, HIDDEN, INTERMEDIATE)
    with torch.no_grad():
        for local, expert in enumerate(expert_ids):
            w13, w2 = expert_weights(expert)
            store.w13[local].copy_(w13)
            store.w2[local].copy_(w2)
    return store


def held_experts(store: ExpertWeights) -> list[int]:
    """The expert each slot's weights belong to, read from the weights themselves."""
    return [int(store.w13[local, 0, 0]) for local in range(store.num_local_experts)]


def test_staged_slots_are_not_in_force_before_commit_and_discard_drops_them():
    store = store_holding([0, 1, 2])
    store.stage(0, 2, store.read_slot(2))
    store.stage(2, 0, store.read_slot(0))      # reads the slot as it is: nothing staged is in force yet
    assert held_experts(store) == [0, 1, 2] and store.expert_ids == [0, 1, 2]
    store.commit()
    assert held_experts(store) == [2, 1, 0] and store.expert_ids == [2, 1, 0]
    assert torch.equal(store.w2[0], expert_weights(2)[1]), "w2 travels with w13"
    store.stage(1, 0, store.read_slot(0))
    store.discard()
    store.commit()
    assert held_experts(store) == [2, 1, 0] and store.expert_ids == [2, 1, 0]


def test_staging_a_wrong_buffer_is_refused():
    store = store_holding([0, 1])
    with pytest.raises(ValueError, match="expected"):
        store.stage(0, 1, torch.zeros(store.slot_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected uint8"):   # right size, wrong type
        store.stage(0, 1, torch.zeros(store.slot_bytes // 4, dtype=torch.float32))
    with pytest.raises(IndexError, match="local slot 2"):
        store.stage(2, 1, store.empty_slot())


# previous: the static placement of 6 experts in 8 slots on 2 ranks ([0..5, 0, 1]); new: experts swapped
# across ranks and within a rank, one replica moved
NEW = torch.tensor([[3, 1, 2, 0, 4, 5, 1, 2]])


def _migrate_on_rank(commit: bool) -> list[int]:
    rank = dist.get_rank()
    previous = static_placement(1, NUM_EXPERTS, 8, 2)
    new = Placement.from_phy2log(NEW, NUM_EXPERTS, num_ranks=2)
    store = store_holding(previous.phy2log[0, list(previous.geometry.rank_slots(rank))].tolist())
    migrate_layer(plan_migration(previous, new), previous, 0, store, rank, group=None)
    assert held_experts(store) == store.expert_ids, "a staged copy was written before commit"
    if commit:
        store.commit()
    else:
        store.discard()
    assert held_experts(store) == store.expert_ids
    return store.expert_ids


@pytest.mark.parametrize("commit", [True, False])
def test_migration_realises_the_new_placement_or_leaves_the_old_one(ranks, commit):
    held = ranks(2).run(_migrate_on_rank, commit)
    expected = NEW[0] if commit else static_placement(1, NUM_EXPERTS, 8, 2).phy2log[0]
    assert held[0] + held[1] == expected.tolist()
