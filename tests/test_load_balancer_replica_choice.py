import pytest
import torch

from moe_runtime.load_balancer import Placement, choose_replicas, local_replica_slots, replica_tables, static_placement
from moe_runtime.load_balancer.replica_choice import replica_table


def naive_choice(ids, placement, layer, my_rank):
    """Per-token Python reference of the documented rule."""
    per_rank = placement.slots_per_rank
    out = torch.empty_like(ids)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            replicas = [s for s in placement.log2phy[layer, ids[t, k]].tolist() if s >= 0]
            local = [s for s in replicas if s // per_rank == my_rank]
            out[t, k] = local[0] if local else replicas[(t + my_rank) % len(replicas)]
    return out


def test_identity_placement_is_a_fast_path():
    placement = static_placement(1, 8, 8, 4)
    table = replica_table(placement, 0, rank=1, device="cpu")
    assert table.is_identity
    ids = torch.randint(0, 8, (5, 2))
    assert choose_replicas(ids, table) is ids


def test_no_replicas_is_a_lookup():
    phy2log = torch.tensor([[3, 1, 0, 2]])
    placement = Placement.from_phy2log(phy2log, num_experts=4, num_ranks=2)
    ids = torch.tensor([[0, 3], [2, 1]])
    table = replica_table(placement, 0, rank=0, device="cpu")
    assert not table.is_identity and not table.has_replicas
    slots = choose_replicas(ids, table)
    assert torch.equal(phy2log[0][slots], ids)


@pytest.mark.parametrize("my_rank", [0, 1, 2, 3])
def test_matches_per_token_reference(my_rank):
    # 8 experts, 16 slots, 4 ranks: expert 0 on all ranks, expert 1 on ranks 1 and 3.
    phy2log = torch.tensor([[0, 2, 3, 4, 0, 1, 5, 6, 0, 7, 2, 3, 0, 1, 4, 5]])
    placement = Placement.from_phy2log(phy2log, num_experts=8, num_ranks=4)
    ids = torch.randint(0, 8, (37, 3), generator=torch.Generator().manual_seed(my_rank))
    slots = choose_replicas(ids, replica_table(placement, 0, my_rank, "cpu"))
    assert torch.equal(slots, naive_choice(ids, placement, 0, my_rank))
    assert torch.equal(phy2log[0][slots], ids), "every slot holds the requested expert"


def test_prefers_local_replica_and_spreads_the_rest_evenly():
    # Expert 0 on ranks 0 and 2 (slots 0 and 4); 4 ranks of 2 slots, 5 experts.
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 4, 1, 2]])
    placement = Placement.from_phy2log(phy2log, num_experts=5, num_ranks=4)
    ids = torch.zeros(100, 1, dtype=torch.long)
    on_rank2 = choose_replicas(ids, replica_table(placement, 0, rank=2, device="cpu"))
    assert (on_rank2 == 4).all(), "rank 2 holds expert 0 and must use it"
    on_rank1 = choose_replicas(ids, replica_table(placement, 0, rank=1, device="cpu"))
    assert torch.bincount(on_rank1.flatten(), minlength=8)[[0, 4]].tolist() == [50, 50]
    # Over all ranks sending equal tokens, each replica of expert 0 gets half.
    total = sum(
        torch.bincount(choose_replicas(ids, replica_table(placement, 0, r, "cpu")).flatten(), minlength=8)
        for r in range(4)
    )
    assert total[[0, 4]].tolist() == [200, 200]


def test_local_replica_slots():
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 4, 1, 2]])
    placement = Placement.from_phy2log(phy2log, num_experts=5, num_ranks=4)
    assert local_replica_slots(placement, 0, rank=3).tolist() == [-1, 6, 7, -1, -1]
    assert local_replica_slots(placement, 0, rank=0).tolist() == [0, 1, -1, -1, -1]


def test_tables_live_on_the_step_device_and_are_built_per_placement_not_per_step():
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 4, 1, 2], [4, 3, 2, 1, 0, 1, 2, 3]])
    placement = Placement.from_phy2log(phy2log, num_experts=5, num_ranks=4)
    tables = replica_tables(placement, rank=1, device="meta")
    assert len(tables) == 2
    for table in tables:
        assert {t.device.type for t in (table.log2phy, table.logcnt, table.local_slot)} == {"meta"}
        assert table.rank == 1
    # the router's ids live on the step device; the choice never touches a CPU tensor
    slots = choose_replicas(torch.zeros(3, 2, dtype=torch.long, device="meta"), tables[0])
    assert slots.device.type == "meta" and slots.shape == (3, 2)
    cpu_tables = replica_tables(placement, rank=1, device="cpu")
    assert [t.local_slot.tolist() for t in cpu_tables] == [[-1, -1, 2, 3, -1], [-1, 3, 2, -1, -1]]


def test_rejects_flat_ids():
    placement = static_placement(1, 4, 8, 2)
    with pytest.raises(ValueError, match="logical_ids must be"):
        choose_replicas(torch.zeros(4, dtype=torch.long), replica_table(placement, 0, 0, "cpu"))
