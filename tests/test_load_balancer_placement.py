import pytest
import torch

from moe_runtime.load_balancer import Placement, balancedness, rank_load, static_placement


def test_static_placement_identity_then_round_robin_replicas():
    placement = static_placement(num_layers=2, num_experts=8, num_slots=12, num_ranks=4)
    assert placement.phy2log[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert placement.logcnt[1].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert placement.log2phy[0, 0].tolist() == [0, 8]
    assert placement.log2phy[0, 7].tolist() == [7, -1]
    assert int(placement.colocated_replicas().sum()) == 0


@pytest.mark.parametrize("experts,slots,ranks", [(4, 8, 2), (6, 18, 3), (5, 10, 5), (16, 64, 8)])
def test_static_placement_never_colocates(experts, slots, ranks):
    placement = static_placement(1, experts, slots, ranks)
    placement.validate()
    assert int(placement.colocated_replicas().sum()) == 0


@pytest.mark.parametrize(
    "experts,slots,ranks,nodes,message",
    [
        (8, 10, 4, 1, "divisible by num_ranks"),
        (8, 4, 2, 1, "every expert needs a slot"),
        (4, 12, 2, 1, "more than 2 replicas"),
        (8, 8, 4, 3, "num_ranks .4. must be divisible by num_nodes"),
        (8, 8, 0, 1, "num_ranks must be a positive int"),
    ],
)
def test_layout_errors_name_the_problem(experts, slots, ranks, nodes, message):
    with pytest.raises(ValueError, match=message):
        static_placement(1, experts, slots, ranks, nodes)


def test_from_phy2log_builds_consistent_maps():
    phy2log = torch.tensor([[2, 0, 1, 0, 3, 2], [3, 3, 3, 0, 1, 2]])
    placement = Placement.from_phy2log(phy2log, num_experts=4, num_ranks=3, check=False)
    assert placement.logcnt.tolist() == [[2, 1, 2, 1], [1, 1, 1, 3]]
    assert placement.log2phy[0, 0].tolist() == [1, 3, -1]
    assert placement.log2phy[1, 3].tolist() == [0, 1, 2]
    # Layer 1 holds expert 3 twice on rank 0 (slots 0 and 1).
    assert placement.colocated_replicas().tolist() == [0, 1]
    with pytest.raises(ValueError, match="layer 1 has 1 replicas sharing a rank"):
        placement.validate()


def test_validate_rejects_missing_expert_and_bad_ids():
    with pytest.raises(ValueError, match="expert 3 has no slot"):
        Placement.from_phy2log(torch.tensor([[0, 1, 2, 0]]), num_experts=4, num_ranks=2)
    with pytest.raises(ValueError, match="outside"):
        Placement.from_phy2log(torch.tensor([[0, 1, 2, 7]]), num_experts=4, num_ranks=2)


def test_balancedness_splits_replicated_load_evenly():
    # Slots: rank 0 = [0, 1], rank 1 = [2, 0]; expert 0 has two replicas.
    placement = Placement.from_phy2log(torch.tensor([[0, 1, 2, 0]]), num_experts=3, num_ranks=2)
    load = torch.tensor([[10.0, 2.0, 4.0]])
    assert rank_load(load, placement).tolist() == [[7.0, 9.0]]
    assert balancedness(load, placement).tolist() == pytest.approx([8.0 / 9.0])
    assert balancedness(torch.zeros(1, 3), placement).tolist() == [1.0]


def test_balancedness_rejects_bad_load():
    placement = static_placement(1, 4, 4, 2)
    with pytest.raises(ValueError, match="load has 5 experts"):
        balancedness(torch.ones(1, 5), placement)
    with pytest.raises(ValueError, match="negative"):
        balancedness(-torch.ones(1, 4), placement)
