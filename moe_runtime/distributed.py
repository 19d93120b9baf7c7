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


def init_distributed(rank: int, world_size: int, device: torch.device, rendezvous: str, master_addr: str,
                     master_port: int, timeout_s: float, loopback_only: bool = False) -> None:
    """Join the job's process group.

    `rendezvous` is a torch.distributed init_method: `file://...` (one node: a store file in the
    front's private directory, so no TCP store listens anywhere) or `env://` (multi-node and
    torchrun: MASTER_ADDR/PORT, set by torchrun itself or from the front's setup). With
    `loopback_only`, gloo's and NCCL's own connections between ranks bind the loopback interface.
    """
    if rendezvous == "env://":
        os.environ.setdefault("MASTER_ADDR", master_addr)
        os.environ.setdefault("MASTER_PORT", str(master_port))
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
    if loopback_only:
        interface = loopback_interface()
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        os.environ["NCCL_SOCKET_IFNAME"] = interface
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("rank %d/%d joined (%s)", rank, world_size, backend)


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name == "lo" or name.startswith("lo0"):
            return name
    raise RuntimeError(f"no loopback network interface among {names}")


def build_parallel_context(layout: ParallelLayout, rank: int, device: torch.device, num_layers: int) -> ParallelContext:
    """This rank's groups. Ranks are laid out stage by stage: rank = stage * stage_size + local.

    Within a stage, the EP group is the stage and each DP attention worker is `attn_tp` consecutive
    ranks; a pipeline group joins the ranks at the same local position of every stage. Every rank
    creates every group in the same order, as torch.distributed requires.
    """
    size, tp, dp_size = layout.stage_size, layout.attn_tp, layout.dp_size
    stage, local = divmod(rank, size)
    stage_groups = [dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(layout.pp)]
    tp_groups = {
        (s, d): dist.new_group(list(range(s * size + d * tp, s * size + (d + 1) * tp)))
        for s in range(layout.pp) for d in range(dp_size)
    }
    pp_groups = [dist.new_group([position + s * size for s in range(layout.pp)]) for position in range(size)]
    split = layout.stage_layers(num_layers)
    first_layer = sum(split[:stage])
    return ParallelContext(
        world_size=layout.world_size, rank=rank, device=device,
        ep_size=layout.ep, ep_rank=local if layout.ep > 1 else 0,
        ep_group=dist.group.WORLD if layout.pp == 1 else stage_groups[stage],
        dp_size=dp_size, dp_rank=local // tp,
        attn_tp_size=tp, attn_tp_rank=local % tp, attn_tp_group=tp_groups[(stage, local // tp)],
        pp_size=layout.pp, pp_rank=stage, pp_group=pp_groups[local],
        pp_prev_rank=rank - size if stage > 0 else None,
        pp_next_rank=rank + size if stage < layout.pp - 1 else None,
        pp_last_rank=local + (layout.pp - 1) * size,
        dense_tp=layout.tp > 1,
        stage_layers=(first_layer, first_layer + split[stage]) if layout.pp > 1 else None,
    )
