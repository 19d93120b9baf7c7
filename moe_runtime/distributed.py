"""Start torch.distributed for one worker rank and build its ParallelContext (groups made once)."""
from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

from moe_runtime.parallel_context import ParallelContext
from moe_runtime.parallel_layout import ParallelLayout

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, device: torch.device, master_addr: str, master_port: int,
                     timeout_s: float) -> None:
    """env:// rendezvous, so the same code runs under torchrun (which sets these variables itself)."""
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("rank %d/%d joined (%s)", rank, world_size, backend)


def build_parallel_context(layout: ParallelLayout, rank: int, device: torch.device) -> ParallelContext:
    """Groups: the EP group is the whole world; each DP attention worker is `attn_tp` consecutive ranks.

    Every rank creates every group in the same order, as torch.distributed requires.
    """
    tp = layout.attn_tp
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(layout.dp_attn)]
    return ParallelContext(
        world_size=layout.world_size, rank=rank, device=device,
        ep_size=layout.ep, ep_rank=rank, ep_group=dist.group.WORLD,
        dp_size=layout.dp_attn, dp_rank=rank // tp,
        attn_tp_size=tp, attn_tp_rank=rank % tp, attn_tp_group=tp_groups[rank // tp],
    )
