"""One worker rank's process: join torch.distributed, build its share of the model, run the lock-step loop."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from moe_runtime.engine_config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    rank: int
    world_size: int
    config: EngineConfig
    master_addr: str
    master_port: int
    num_threads: int
    parent_pid: int
    log_level: int = logging.WARNING


def exit_when_parent_dies(front_pid: int, poll_s: float = 1.0) -> None:
    """A worker never outlives the front process, even when the front is killed with SIGKILL.

    (Workers are forked by a fork server, so the front is not their parent: watch its pid.)"""

    def watch() -> None:
        while True:
            try:
                os.kill(front_pid, 0)
            except ProcessLookupError:
                os._exit(3)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def worker_main(spec: WorkerSpec, commands, results) -> None:
    from attention_dp.lockstep import LockstepLoop
    from attention_dp.messages import WorkerFailed, WorkerReady

    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s rank{spec.rank} %(name)s: %(message)s")
    exit_when_parent_dies(spec.parent_pid)
    try:
        torch.set_num_threads(spec.num_threads)
        core = build_worker_engine(spec)
        local_bytes, total_bytes = core.resident_expert_bytes()
        weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
        results.put(WorkerReady(spec.rank, core.parallel.dp_rank, core.block_manager.num_blocks,
                                core.block_manager.block_size, core.max_model_len, local_bytes, total_bytes,
                                weight_bytes, core.parallel.pp_rank))
        LockstepLoop(core, commands, results, core.parallel, build_rebalancer(core, spec.config)).run()
    except BaseException as exc:  # report, then die: the front tears the job down
        results.put(WorkerFailed(spec.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    os._exit(0)


def build_rebalancer(core, config: EngineConfig):
    """The live rebalancer of this rank, or None when there is nothing to balance (dense, one rank)."""
    from load_balancer.live_rebalancer import LiveRebalancer, RebalancePolicy

    if not getattr(core.executor, "experts_by_layer", None) or core.parallel.ep_size == 1:
        return None
    policy = RebalancePolicy(interval_steps=config.eplb_interval, threshold=config.eplb_threshold,
                             layers_per_step=config.eplb_layers_per_step, num_nodes=config.nnodes)
    return LiveRebalancer(core.executor, policy, group=core.parallel.ep_group)


def build_worker_engine(spec: WorkerSpec):
    from kernels import get_kernels  # noqa: F401  (imported here so spawn start-up stays light)
    from moe_runtime.distributed import build_parallel_context, init_distributed
    from moe_runtime.engine_core import EngineCore
    from moe_runtime.ep_executor import ExpertParallelExecutor

    config = spec.config
    device = config.resolved_device()
    if device.type == "cuda":
        device = torch.device("cuda", spec.rank % torch.cuda.device_count())
        config = dataclasses.replace(config, device=str(device))
    init_distributed(spec.rank, spec.world_size, device, spec.master_addr, spec.master_port, config.worker_timeout_s)
    layout = config.layout()
    from moe_runtime.model_config import load_hf_config

    parallel = build_parallel_context(layout, spec.rank, device, load_hf_config(config.model).num_hidden_layers)

    def executor_factory(kernels, hf_config, dtype):
        return ExpertParallelExecutor(kernels, parallel, backend=config.a2a_backend,
                                      num_redundant_experts=config.num_redundant_experts,
                                      hidden_size=hf_config.hidden_size, dtype=dtype,
                                      record_window=config.eplb_window)

    return EngineCore(config, parallel, executor_factory)
