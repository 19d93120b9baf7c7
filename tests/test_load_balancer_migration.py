import pytest
import torch

from moe_runtime.load_balancer import plan_migration, rebalance, static_placement


def test_plan_turns_previous_into_new_reading_from_real_holders():
    experts, slots, ranks, nodes = 16, 24, 8, 2
    previous = static_placement(2, experts, slots, ranks, nodes)
    load = torch.arange(1, experts + 1, dtype=torch.float64).pow(-1.5).repeat(2, 1) * 1000
    new = rebalance(load, slots, ranks, nodes, previous=previous, min_gain_per_move=0.0)
    plan = plan_migration(previous, new)

    assert plan.num_moved == int((previous.phy2log != new.phy2log).sum())
    assert plan.num_moved == int(new.stats.experts_moved.sum())
    applied = previous.phy2log.clone()
    applied[plan.layer, plan.slot] = plan.expert
    assert torch.equal(applied, new.phy2log)

    slot_rank = previous.slot_rank()
    for layer, expert, src, dst, slot in zip(
        plan.layer.tolist(), plan.expert.tolist(), plan.src_rank.tolist(), plan.dst_rank.tolist(), plan.slot.tolist()
    ):
        holders = slot_rank[previous.phy2log[layer] == expert].tolist()
        assert src in holders
        assert dst == slot // (slots // ranks)
        if dst in holders:
            assert src == dst
        elif any(h // 4 == dst // 4 for h in holders):
            assert src // 4 == dst // 4, "a same-node source exists and should be used"
    assert plan.per_layer(2).sum() == plan.num_moved
    assert plan.num_cross_node <= plan.num_remote <= plan.num_moved
    assert plan.to_dict()["num_moved"] == plan.num_moved


def test_identical_placements_need_no_copies():
    placement = static_placement(3, 8, 12, 4)
    plan = plan_migration(placement, placement)
    assert plan.num_moved == 0 and plan.sends_per_rank().sum() == 0


def test_mismatched_placements_are_rejected():
    with pytest.raises(ValueError, match="differ in shape"):
        plan_migration(static_placement(2, 8, 8, 4), static_placement(3, 8, 8, 4))
