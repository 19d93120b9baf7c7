"""Explicit parallel state, built once per worker and passed down (no globals)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in the job.

    world = pp stages x stage ranks. Within a stage: the EP group spans the stage's ranks; each DP
    attention worker spans `attn_tp_size x cp_size` of them. The `attn_tp_size` ranks of an
    attention-TP group split attention heads (for a dense model with tp > 1 they also split the MLP
    and the vocabulary: `dense_tp`) and see the same tokens; with context parallelism the worker's
    `cp_size` attention-TP groups each take a share of every step's tokens and exchange their new K/V
    over the context-parallel group (moe_runtime/models/context_parallel.py). Across stages, the ranks at
    the same position form a pipeline group that passes activations on.

    Every scope has two groups. The data group (`*_group`, NCCL on GPU) moves activations and
    expert weights. The control group (`*_control_group`, always gloo) carries the small CPU
    tensors the ranks agree on (lock-step flags, the rebalance plan, sampled tokens): a CPU tensor
    cannot go over NCCL, and control traffic never queues behind a large data transfer.
    Group ranks of the EP group are EP ranks and of the pipeline group stage indices.
    """

    world_size: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")
    world_control_group: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    ep_control_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_tp_group: Any = None
    attn_tp_control_group: Any = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None                # the worker's ranks at this attention-TP position (None when cp_size == 1)
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Any = None
    pp_control_group: Any = None
    pp_prev_rank: int | None = None     # global rank of the previous stage's peer
    pp_next_rank: int | None = None
    pp_last_rank: int | None = None     # global rank of the last stage's peer (samples the tokens)
    dense_tp: bool = False              # dense MLP, embedding and LM head split over the attention-TP group
    stage_layers: tuple[int, int] | None = None  # [first, last) decoder layers of this stage; None = all

    @property
    def worker_rank(self) -> int:
        """This rank's place among its DP attention worker's ranks on its stage."""
        return self.cp_rank * self.attn_tp_size + self.attn_tp_rank

    @property
    def is_worker_leader(self) -> bool:
        """The first rank of its DP attention worker (on each stage): the one that speaks for the worker."""
        return self.worker_rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelContext":
        return cls(device=torch.device(device))


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank` (None = the default group)."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def group_rank(group, rank: int) -> int:
    """The rank within `group` of global rank `rank` (None = the default group)."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_group_rank(group, rank)


def agree_on_minimum(value: int, control_group) -> int:
    """The smallest `value` over the ranks of the (gloo) `control_group`."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=control_group)
    return int(tensor.item())
