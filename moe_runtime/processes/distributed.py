"""Start torch.distributed for one worker rank and build its ParallelContext (groups made once)."""
from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.config.parallel_layout import ParallelLayout

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free right now: all are held open until all are chosen (two one-at-a-time
    picks may return the same port, and then the job's store and its control socket collide)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


FRONT_STORE = "front-store://"   # `front-store://host:port/generation`: a TCPStore the front serves


def init_distributed(rank: int, world_size: int, device: torch.device, rendezvous: str, master_addr: str,
                     master_port: int, timeout_s: float, loopback_only: bool = False) -> None:
    """Join the job's process group.

    `rendezvous` is a torch.distributed init_method: `file://...` (one node: a store file in the
    front's private directory, so no TCP store listens anywhere) or `env://` (multi-node and
    torchrun: MASTER_ADDR/PORT, set by torchrun itself or from the front's setup); or, for the ranks of a
    multi-node job that re-form after a loss, `front-store://host:port/generation` (the first store lived in
    rank 0's process, which may be the one lost). With
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
    timeout = datetime.timedelta(seconds=timeout_s)
    if rendezvous.startswith(FRONT_STORE):   # a re-formed multi-node job meets in a store its front serves
        address, prefix = rendezvous[len(FRONT_STORE):].split("/", 1)
        host, port = address.rsplit(":", 1)
        store = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size, timeout=timeout)
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

    Within a stage, the EP group is the stage and each DP attention worker is `attn_tp x cp`
    consecutive ranks, context-parallel position major: worker rank = cp_rank * attn_tp + attn_tp_rank.
    A pipeline group joins the ranks at the same local position of every stage. Each scope gets a
    data group (the job's backend) and a gloo control group (see ParallelContext).
    """
    size, tp, dp_size, width = layout.stage_size, layout.attn_tp, layout.dp_size, layout.worker_size
    stage, local = divmod(rank, size)
    worker, in_worker = divmod(local, width)
    cp_rank, tp_rank = divmod(in_worker, tp)
    groups = ScopeGroups.create(layout)
    split = layout.stage_layers(num_layers)
    first_layer = sum(split[:stage])
    return ParallelContext(
        world_size=layout.world_size, rank=rank, device=device, world_control_group=groups.world_control,
        ep_size=layout.ep, ep_rank=local if layout.ep > 1 else 0,
        ep_group=groups.stage[stage], ep_control_group=groups.stage_control[stage],
        dp_size=dp_size, dp_rank=worker,
        attn_tp_size=tp, attn_tp_rank=tp_rank, attn_tp_group=groups.attn_tp[(stage, worker, cp_rank)],
        attn_tp_control_group=groups.attn_tp_control[(stage, worker, cp_rank)],
        cp_size=layout.cp, cp_rank=cp_rank, cp_group=groups.context.get((stage, worker, tp_rank)),
        pp_size=layout.pp, pp_rank=stage, pp_group=groups.pipeline[local],
        pp_control_group=groups.pipeline_control[local],
        pp_prev_rank=rank - size if stage > 0 else None,
        pp_next_rank=rank + size if stage < layout.pp - 1 else None,
        pp_last_rank=local + (layout.pp - 1) * size,
        dense_tp=layout.tp > 1,
        stage_layers=(first_layer, first_layer + split[stage]) if layout.pp > 1 else None,
    )


@dataclass
class ScopeGroups:
    """Every group of the job, data and control, keyed by stage, (stage, DP worker) or stage position."""

    world_control: Any
    stage: list
    stage_control: list
    attn_tp: dict                  # (stage, worker, cp rank) -> group
    attn_tp_control: dict
    context: dict                  # (stage, worker, attention-TP rank) -> group; empty when cp == 1
    pipeline: list
    pipeline_control: list

    @classmethod
    def create(cls, layout: ParallelLayout) -> "ScopeGroups":
        """Every rank creates every group in the same order, as torch.distributed requires (also the
        groups it is not in). With one stage, the stage is the world and reuses its groups."""
        size, tp, pp, width = layout.stage_size, layout.attn_tp, layout.pp, layout.worker_size

        def pair(ranks: list[int]):
            return dist.new_group(ranks), dist.new_group(ranks, backend="gloo")

        world_control = dist.new_group(list(range(layout.world_size)), backend="gloo")
        if pp == 1:
            stage, stage_control = [dist.group.WORLD], [world_control]
        else:
            stage, stage_control = map(list, zip(*(pair(list(range(s * size, (s + 1) * size))) for s in range(pp))))
        attn_tp, attn_tp_control, context = {}, {}, {}
        for s in range(pp):
            for d in range(layout.dp_size):
                first = s * size + d * width
                for c in range(layout.cp):
                    key = (s, d, c)
                    attn_tp[key], attn_tp_control[key] = pair(list(range(first + c * tp, first + (c + 1) * tp)))
                for t in range(tp if layout.cp > 1 else 0):
                    context[(s, d, t)] = dist.new_group([first + c * tp + t for c in range(layout.cp)])
        pipeline, pipeline_control = [], []
        for position in range(size):
            data, control = pair([position + s * size for s in range(pp)])
            pipeline.append(data)
            pipeline_control.append(control)
        return cls(world_control, stage, stage_control, attn_tp, attn_tp_control, context, pipeline, pipeline_control)
