"""What the ranks of one DP worker agree on about their tiers, over the groups that span exactly that worker.

A worker's ranks (attention-TP ranks x context-parallel ranks x pipeline stages) run the same scheduler and look up
the same tier index, so they plan the same loads; only whether each load's bytes came back can differ (one rank's
file corrupted). Reducing over each axis of the worker in turn gives the whole worker's minimum, without the other
DP workers (which never reach this point at the same step). One rank alone agrees with itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.kv_tiers.tier_key import TierKey


class WorkerAgreement:
    def __init__(self, parallel: ParallelContext):
        groups = []   # (group, device of its tensors)
        if parallel.attn_tp_size > 1 and parallel.attn_tp_control_group is not None:
            groups.append((parallel.attn_tp_control_group, torch.device("cpu")))
        if parallel.cp_size > 1 and parallel.cp_group is not None:
            groups.append((parallel.cp_group, parallel.device))
        if parallel.pp_size > 1 and parallel.pp_control_group is not None:
            groups.append((parallel.pp_control_group, torch.device("cpu")))
        self.groups = groups

    @property
    def alone(self) -> bool:
        return not self.groups

    def minimum(self, values: list[int]) -> list[int]:
        """Each of `values` (the same length on every rank) as the smallest any rank of the worker has."""
        if self.alone or not values:
            return list(values)
        result = torch.tensor(values, dtype=torch.int64)
        for group, device in self.groups:
            moved = result.to(device)
            dist.all_reduce(moved, op=dist.ReduceOp.MIN, group=group)
            result = moved.cpu()
        return result.tolist()

    def common_keys(self, keys: list[TierKey]) -> list[TierKey]:
        """The keys every rank of the worker has (a disk tier's files after a restart), in the order the worker's first
        rank lists them (its files' ages: the ranks' own clocks may order ties apart)."""
        order = list(keys)
        for group, device in self.groups:
            encoded = torch.tensor([[key.kind, key.block_hash] for key in order], dtype=torch.int64,
                                   device=device).reshape(-1, 2)
            size = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
            sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
            dist.all_gather(sizes, size, group=group)
            longest = max(int(s.item()) for s in sizes)
            padded = torch.full((longest, 2), -2, dtype=torch.int64, device=device)
            padded[: len(encoded)] = encoded
            gathered = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(gathered, padded, group=group)
            lists = [[TierKey(int(kind), int(block_hash)) for kind, block_hash in rows[: int(count.item())].tolist()]
                     for rows, count in zip(gathered, sizes)]
            everywhere = set.intersection(*(set(listed) for listed in lists))
            order = [key for key in lists[0] if key in everywhere]
        return order
