"""A rank's part when its job lost ranks: leave the broken groups, wait for the front's `Reform`, go on with the others.

A rank that stays alive keeps everything it loaded: its share of the model, its KV cache and what its prefix cache
holds. It drops its requests (the front resumes each from its tokens so far, routed back to the worker that had
it while that worker lives, where the prefix cache gives most of its KV back), leaves its process groups (so a
peer still blocked in a collective with it fails at once instead of at the timeout), and, told the survivors and a
fresh rendezvous, joins new groups as a smaller EP + DP-attention job: `MoEExecutor.reform` keeps every surviving
slot and loads the experts no survivor holds from the checkpoint into reclaimed redundant slots.

Only layouts where a DP worker is one rank re-form (attention TP, context and pipeline parallelism leave a
worker or stage without a peer; `can_reform` says which): the others end or restart as a whole.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from moe_runtime.attention_dp.messages import Reform, Shutdown
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.parallel_context import ParallelContext, agree_on_minimum
from moe_runtime.kv_tiers.engine_tiers import agreed_entry_sizes
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.processes.collective_interrupt import CollectiveInterrupt, shut_tcp_connections
from moe_runtime.processes.distributed import build_parallel_context, init_distributed

logger = logging.getLogger(__name__)


class ShutdownWhileWaiting(Exception):
    """The front said Shutdown (or went away) instead of Reform."""


def can_reform(config: EngineConfig) -> bool:
    """Whether a lost rank of this job can be absorbed by the others: EP with DP attention, one rank per DP
    worker and one pipeline stage, no decode capture (its graphs hold the old groups). A P/D instance too: its
    parked exports are freed and its imports dropped with its requests (the front resumes them)."""
    layout = config.layout()
    return (layout.ep > 1 and layout.worker_size == 1 and layout.pp == 1 and not config.enable_torch_compile
            and config.max_rank_restarts > 0)


def leave_process_groups(device: torch.device, keep_ports: frozenset[int] = frozenset(), shut: bool = True) -> None:
    """Drop every group of the broken job, so that peers blocked in a collective with this rank fail at once.

    NCCL aborts its communicators. Gloo has no abort that reaches the peers (its groups stay referenced, their
    connections open, and a peer waiting on this rank waits out the timeout), so this rank shuts its side of
    its TCP connections, as its exit would: every peer's pending collective with it fails with "connection
    closed". `keep_ports`: peers' ports whose connections stay (the front's control port across nodes)."""
    if not dist.is_initialized():
        return
    if device.type == "cuda":
        dist.distributed_c10d._abort_process_group()   # NCCL: a communicator with a dead peer cannot be destroyed
        return
    if shut:   # not when every rank leaves at an agreed boundary: none waits on another, and an idle pair's
        shut_tcp_connections(keep_ports)   # shutdown can take down gloo's own event loop
    dist.destroy_process_group()


def await_reform(commands) -> Reform:
    """The front's `Reform`; the commands before it were meant for the broken job and are dropped."""
    while True:
        command = commands.get()
        if isinstance(command, Reform):
            return command
        if isinstance(command, Shutdown):
            raise ShutdownWhileWaiting()


def mirror_engine_start(core, parallel: ParallelContext) -> None:
    """The collectives a replacement's EngineCore runs while it starts, joined by a rank that has long started, in
    the same order: the checkpoint's consumed-tensor check (this rank read its share long ago: all ones) and the
    KV block count's minimum."""
    names = CheckpointReader.open(core.checkpoint_dir, hf_config=core.hf_config).names()
    consumed = torch.ones(len(names), dtype=torch.uint8)
    dist.all_reduce(consumed, op=dist.ReduceOp.MAX, group=parallel.world_control_group)
    blocks = agree_on_minimum(core.block_manager.num_blocks, parallel.world_control_group)
    if blocks != core.block_manager.num_blocks:
        raise RuntimeError(f"a replacement rank holds {blocks} KV blocks, this rank {core.block_manager.num_blocks}: "
                           "the workers of one job schedule alike")
    if core.tiers is not None:   # the KV tiers' entry sizes, agreed over the job
        agreed_entry_sizes(core.tiers.contents.entry_bytes(), parallel)


def reform_core(core, setup, reform: Reform, rank: int, interrupt: CollectiveInterrupt) -> None:
    """Re-form `core` (this rank's EngineCore) as member `reform.members.index(rank)` of the smaller job."""
    if reform.interrupted:
        interrupt.settle()
    leave_process_groups(core.device, interrupt.keep_ports, shut=not reform.agreed)
    core.drop_requests()
    members = len(reform.members)
    # placement and rebalancing plan over one node: a lost node leaves a count of ranks nodes may not divide
    config: EngineConfig = dataclasses.replace(core.config, ep=members, dp_attn=members, nnodes=1)
    init_distributed(reform.members.index(rank), members, core.device, reform.rendezvous, setup.master_addr,
                     setup.master_port, config.worker_timeout_s, loopback_only=setup.loopback_only)
    parallel: ParallelContext = build_parallel_context(config.layout(), reform.members.index(rank), core.device,
                                                       core.hf_config.num_hidden_layers)
    if reform.joiners:
        mirror_engine_start(core, parallel)
    core.config = config
    core.parallel = parallel
    core.tier_steps.use_parallel(parallel)
    core.model.parallel = parallel
    reloads = core.executor.reform(parallel, config.a2a_backend)
    logger.warning("re-formed as rank %d of %d (generation %d); %d experts reloaded from the checkpoint job-wide",
                   parallel.rank, members, reform.generation, len(reloads))
