"""One layer placed the way DeepSeek's EPLB places it (github.com/deepseek-ai/EPLB).

Replication: each redundant slot goes to the expert with the largest load per
replica, with no cap. Packing: replicas by decreasing load, each onto the
lightest rank that still has room, every rank getting the same slot count.
Hierarchical layouts first pack whole expert groups onto nodes the same way.
Nothing keeps two replicas of one expert off the same rank: the result may
break the placement invariant, and is meant to be repaired (see
`colocation_repair`) before use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_runtime.load_balancer.layout import Layout


@dataclass(frozen=True)
class EplbPlan:
    slot_expert: np.ndarray  # [P] expert of each slot; replicas may share a rank
    node_of_group: np.ndarray  # [G] node of each expert group (G = 1 in global mode)


def eplb_plan(load: np.ndarray, layout: Layout) -> EplbPlan:  # load: [E]
    groups = layout.num_groups if layout.hierarchical else 1
    nodes = layout.num_nodes if layout.hierarchical else 1
    group_load = load.reshape(groups, layout.group_size).sum(1)  # [G]
    node_of_group, _ = pack_by_load(group_load, nodes)
    slots_per_node = layout.num_slots // nodes
    ranks_per_node = layout.num_ranks // nodes
    slot_expert = np.empty(layout.num_slots, dtype=np.int64)
    for node in range(nodes):
        node_groups = np.flatnonzero(node_of_group == node)
        experts = (node_groups[:, None] * layout.group_size + np.arange(layout.group_size)).ravel()  # [E/N]
        replica = replicate_by_load(load[experts], slots_per_node)  # [P/N] index into `experts`
        counts = np.bincount(replica, minlength=experts.size)
        rank_of, position = pack_by_load(load[experts][replica] / counts[replica], ranks_per_node)
        order = np.argsort(layout.geometry.slot_of(rank_of, position))
        slot_expert[node * slots_per_node : (node + 1) * slots_per_node] = experts[replica[order]]
    return EplbPlan(slot_expert, node_of_group)


def replicate_by_load(load: np.ndarray, num_slots: int) -> np.ndarray:
    """[num_slots] expert of each replica: experts 0..E-1, then redundant ones in the order given.

    Each redundant replica goes to the expert with the largest load per replica
    (lowest id on ties); no cap on replicas per expert.
    """
    counts = np.ones(load.shape[0], dtype=np.int64)
    per_replica = load.astype(np.float64).copy()
    extra = np.empty(num_slots - load.shape[0], dtype=np.int64)
    for index in range(extra.size):
        expert = int(np.argmax(per_replica))
        extra[index] = expert
        counts[expert] += 1
        per_replica[expert] = load[expert] / counts[expert]
    return np.concatenate([np.arange(load.shape[0]), extra])


def pack_by_load(weight: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """([n] bin of each item, [n] its position in the bin): n / num_bins items per bin.

    Items heaviest first (stable on ties), each into the lightest bin with
    room (lowest index on ties); positions follow arrival order.
    """
    per_bin = weight.shape[0] // num_bins
    bin_of = np.empty(weight.shape[0], dtype=np.int64)
    position = np.empty(weight.shape[0], dtype=np.int64)
    bin_load = np.zeros(num_bins, dtype=np.float64)
    bin_fill = np.zeros(num_bins, dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        target = int(np.argmin(np.where(bin_fill < per_bin, bin_load, np.inf)))
        bin_of[item] = target
        position[item] = bin_fill[target]
        bin_load[target] += weight[item]
        bin_fill[target] += 1
    return bin_of, position
