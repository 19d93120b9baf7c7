"""DeepSeek's EPLB algorithm, rewritten from its published description.

Baseline for bench_rebalance.py (github.com/deepseek-ai/EPLB, eplb.py):
- replication: each redundant slot goes to the logical expert with the largest
  load per replica (no cap on replicas);
- balanced packing: items by decreasing weight, each to the lightest pack that
  still has room; every pack gets the same item count;
- hierarchical mode (groups divisible by nodes): pack expert groups onto nodes,
  replicate within each node (slots / nodes slots), pack each node's replicas
  onto its GPUs; otherwise the same with one group on one node (global mode).
Nothing stops two replicas of one expert from landing on the same GPU, and no
previous placement is considered; both are what this benchmark measures.
"""

from __future__ import annotations

import torch


def eplb_replicate(load: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[X, num_slots] expert of each replica; the first X columns are the experts themselves."""
    rows, num_experts = load.shape
    replica_expert = torch.arange(num_experts).repeat(rows, 1)
    counts = torch.ones(rows, num_experts)
    extra = []
    for _ in range(num_slots - num_experts):
        hottest = (load / counts).argmax(-1)  # [X]
        extra.append(hottest)
        counts[torch.arange(rows), hottest] += 1
    if extra:
        replica_expert = torch.cat([replica_expert, torch.stack(extra, 1)], 1)
    return replica_expert


def eplb_pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([X, n] pack of each item, [X, n] its position in the pack), n / num_packs per pack.

    Items go heaviest first; the position is the order in which the pack received them.
    """
    rows, num_items = weight.shape
    per_pack = num_items // num_packs
    pack_of = torch.empty(rows, num_items, dtype=torch.long)
    position = torch.empty(rows, num_items, dtype=torch.long)
    for row in range(rows):
        pack_load = [0.0] * num_packs
        pack_fill = [0] * num_packs
        for item in weight[row].argsort(descending=True, stable=True).tolist():
            pack = min((p for p in range(num_packs) if pack_fill[p] < per_pack), key=lambda p: pack_load[p])
            pack_of[row, item] = pack
            position[row, item] = pack_fill[pack]
            pack_load[pack] += float(weight[row, item])
            pack_fill[pack] += 1
    return pack_of, position


def eplb_rebalance(
    load: torch.Tensor, num_slots: int, num_ranks: int, num_nodes: int, num_groups: int | None
) -> torch.Tensor:
    """[L, P] logical expert per slot (slot s on rank s // (P // W)), as EPLB would place them."""
    load = load.double().cpu()
    num_layers, num_experts = load.shape
    groups = num_groups if num_groups else 1
    if groups % num_nodes:
        groups, num_nodes = 1, 1  # EPLB's global policy
    nodes_used = num_nodes
    group_size = num_experts // groups
    slots_per_node = num_slots // nodes_used
    ranks_per_node = num_ranks // nodes_used
    slots_per_rank = num_slots // num_ranks

    group_load = load.view(num_layers, groups, group_size).sum(-1)  # [L, G]
    node_of_group, _ = eplb_pack(group_load, nodes_used)  # [L, G]
    phy2log = torch.empty(num_layers, num_slots, dtype=torch.long)
    for layer in range(num_layers):
        for node in range(nodes_used):
            node_groups = (node_of_group[layer] == node).nonzero().flatten()
            experts = (node_groups[:, None] * group_size + torch.arange(group_size)).flatten()
            node_load = load[layer, experts][None]  # [1, E/N]
            local = eplb_replicate(node_load, slots_per_node)[0]  # [P/N] index into `experts`
            counts = torch.bincount(local, minlength=experts.numel()).double()
            per_replica = (node_load[0] / counts)[local]
            rank_of, position = eplb_pack(per_replica[None], ranks_per_node)
            order = torch.argsort((rank_of * slots_per_rank + position)[0])
            base = node * slots_per_node
            phy2log[layer, base : base + slots_per_node] = experts[local[order]]
    return phy2log
