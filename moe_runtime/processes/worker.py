"""One worker rank's process: connect to the front, join torch.distributed, build its share of the
model, run the lock-step loop. The same entry serves ranks the front spawns, ranks a remote node
starts (`moe-serve --node-rank N`), and ranks torchrun starts (`python -m moe_runtime.processes.worker`)."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import socket
import traceback

import torch

from moe_runtime.security.control_key import ControlKey
from moe_runtime.attention_dp.control_plane import ControlAddress, WorkerControl, heartbeat_timeout_from_env
from moe_runtime.attention_dp.lockstep import LockstepLoop, ReformRequested
from moe_runtime.attention_dp.messages import Hello, WorkerFailed, WorkerReady
from moe_runtime.load_balancer.live_rebalancer import LiveRebalancer, RebalanceGroups, RebalancePolicy
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.errors import InvalidRequestError
from moe_runtime.kernels.thread_pool import ThreadPlan
from moe_runtime.processes.collective_interrupt import CollectiveInterrupt, block_interrupt_signal
from moe_runtime.processes.reform import ShutdownWhileWaiting, await_reform, can_reform, leave_process_groups, reform_core

logger = logging.getLogger(__name__)

LAST_WORDS_TIMEOUT_S = 5.0   # how long an exiting rank waits for its last message to leave


def worker_main(address, rank: int, transfer_key: TransferKey | None = None) -> None:
    """Run rank `rank` until the front says Shutdown (exit 0) or something fails (exit 1).

    In a job that can absorb a lost rank (`can_reform`), a failure (mostly: a collective broken by a peer's
    death) leaves this rank alive: it says so (`WorkerFailed.awaiting_reform`), leaves its process groups and
    waits for the front's `Reform` (or Shutdown), then goes on in the smaller job (moe_runtime/processes/reform.py).

    `transfer_key`: a P/D instance's KV transfer key, from the front that spawned this rank; ranks started
    elsewhere (None) read it as the front does, from --kv-transfer-key-file's path or $MOE_RUNTIME_KV_KEY."""

    block_interrupt_signal()   # before any thread starts: only the interrupt watcher takes it
    control = WorkerControl(address, Hello(rank=rank, pid=os.getpid(), host=socket.gethostname()))
    setup = control.setup
    logging.basicConfig(level=setup.log_level, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    generation = 0
    try:
        per_node = setup.world_size // setup.config.nnodes   # this host's ranks: one pool each, on its own cores
        ThreadPlan.for_rank(rank % per_node, per_node).apply()
        core = build_worker_engine(setup, rank, transfer_key)
        if setup.generation:   # a lost rank's replacement: its placement is the others' (they gather theirs)
            generation = setup.generation
            core.executor.reform(core.parallel, setup.config.a2a_backend)
        reformable = can_reform(setup.config)
        interrupt = CollectiveInterrupt(frozenset([address.port] if address.port else []))  # the front: kept
        while True:
            control.put(ready_message(core, rank, generation))
            try:
                LockstepLoop(core, control, control, core.parallel, build_rebalancer(core, core.config)).run()
                break
            except ReformRequested as requested:
                reform = requested.reform
            except EOFError:
                raise
            except Exception:  # noqa: BLE001 - a peer's death breaks a collective: the front decides
                if not reformable:
                    raise
                reform = report_and_await_reform(control, core, rank, generation, interrupt)
            while True:   # a re-formation that fails (a member lost meanwhile, the front's interrupt) is retried
                generation = reform.generation   # a failure from here on is this generation's
                try:
                    reform_core(core, setup, reform, rank, interrupt)
                    break
                except Exception:  # noqa: BLE001 - the front decides: another generation, or the end
                    reform = report_and_await_reform(control, core, rank, generation, interrupt)
    except (EOFError, ShutdownWhileWaiting) as ended:  # the front is gone, or ended the job while this rank waited
        os._exit(0 if isinstance(ended, ShutdownWhileWaiting) else 3)
    except BaseException as exc:  # report, then die: the front tears the job down
        try:
            control.put(WorkerFailed(rank=rank, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                                     generation=generation))
            control.flush(LAST_WORDS_TIMEOUT_S)  # ZeroMQ sends from a background thread: let it, before exiting
        except Exception:  # the front may be gone too
            pass
        os._exit(1)
    control.flush(LAST_WORDS_TIMEOUT_S)
    os._exit(0)


def report_and_await_reform(control, core, rank: int, generation: int, interrupt: CollectiveInterrupt):
    """This rank stays alive after a failure: it tells the front, leaves its process groups (so peers blocked on
    it fail at once) and waits for the front's next `Reform` (or Shutdown)."""
    error = traceback.format_exc()
    summary = error.strip().splitlines()[-1]
    logger.warning("generation %d failed here (%s); leaving the process groups, waiting for the front", generation,
                   summary)
    control.put(WorkerFailed(rank=rank, error=summary, traceback=error, generation=generation, awaiting_reform=True))
    leave_process_groups(core.device, interrupt.keep_ports)
    return await_reform(control)


def ready_message(core, rank: int, generation: int) -> WorkerReady:
    local_bytes, total_bytes = core.resident_expert_bytes()
    weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    return WorkerReady(rank=rank, dp_rank=core.parallel.dp_rank, num_kv_blocks=core.block_manager.num_blocks,
                       block_size=core.block_manager.block_size, max_model_len=core.max_model_len,
                       expert_bytes=local_bytes, total_expert_bytes=total_bytes, weight_bytes=weight_bytes,
                       pp_rank=core.parallel.pp_rank, kv_shard=core.transfers.shard(), generation=generation,
                       routing=core.routing.shape)


def build_rebalancer(core, config):
    """The live rebalancer of this rank, or None with one EP rank (nothing to balance).

    Every rank of an expert-parallel job has one, also on a pipeline stage without MoE layers (it joins
    the job-wide agreements and moves nothing), so the stages that have MoE layers balance them. EP > 1
    is the same on every rank, so either every rank has a rebalancer or none has."""

    p = core.parallel
    if p.ep_size == 1:
        return None
    policy = RebalancePolicy(interval_steps=config.eplb_interval, threshold=config.eplb_threshold,
                             layers_per_step=config.eplb_layers_per_step, num_nodes=config.nnodes)
    groups = RebalanceGroups(ep_group=p.ep_group, ep_rank=p.ep_rank, ep_control_group=p.ep_control_group,
                             world_control_group=p.world_control_group, pp_control_group=p.pp_control_group,
                             num_stages=p.pp_size, global_rank=p.rank)
    return LiveRebalancer(core.executor, policy, groups)


def build_worker_engine(setup, rank: int, transfer_key: TransferKey | None = None):
    from moe_runtime.processes.distributed import build_parallel_context, init_distributed
    from moe_runtime.engine.core import EngineCore
    from moe_runtime.config.model_config import load_hf_config

    config = setup.config
    device = config.resolved_device()
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        config = dataclasses.replace(config, device=str(device))
    init_distributed(rank, setup.world_size, device, setup.rendezvous, setup.master_addr, setup.master_port,
                     config.worker_timeout_s, loopback_only=setup.loopback_only)
    layout = config.layout()
    parallel = build_parallel_context(layout, rank, device, load_hf_config(config.model).num_hidden_layers)
    if transfer_key is None and config.disaggregation_mode != "none":
        transfer_key = TransferKey.shared(config.kv_transfer_key_file)
    return EngineCore(config, parallel, transfer_key)


def main(argv: list[str] | None = None) -> None:
    """One rank started by torchrun (RANK, MASTER_ADDR and MASTER_PORT come from torchrun's environment).

    Start the front first, then the ranks, with the same shared control key on every node
    ($MOE_RUNTIME_CONTROL_KEY, or --control-key-file on both sides):

      front:  moe-serve ... --external-workers --master-addr A --master-port P --control-port C
      ranks:  torchrun --nnodes N --nproc-per-node R --master-addr A --master-port P \\
                  -m moe_runtime.processes.worker --control-addr A --control-port C
    """

    parser = argparse.ArgumentParser(prog="python -m moe_runtime.processes.worker", description=inspect.cleandoc(main.__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--control-addr", required=True, help="the front's host (moe-serve --master-addr)")
    parser.add_argument("--control-port", type=int, required=True,
                        help="the front's control port (moe-serve --control-port)")
    parser.add_argument("--control-key-file", default=None,
                        help="file holding the shared control secret (default: $MOE_RUNTIME_CONTROL_KEY)")
    args = parser.parse_args(argv)
    try:
        key = ControlKey.shared(args.control_key_file)
        heartbeat_timeout_ms = heartbeat_timeout_from_env()
    except InvalidRequestError as exc:
        parser.exit(2, f"moe_runtime.processes.worker: error: {exc}\n")
    rank = int(os.environ["RANK"])
    worker_main(ControlAddress.tcp(args.control_addr, args.control_port, key, heartbeat_timeout_ms), rank)


if __name__ == "__main__":
    main()
