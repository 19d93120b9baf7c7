"""A node other than the front's: start this node's worker ranks and wait for them.

`moe-serve ... --nnodes N --node-rank K --master-addr A --master-port P` on node K (K > 0) starts
ranks [K * R, (K + 1) * R) (R = world / N), which connect to the front's control port on A
(default P + 1) and get their configuration from it; this process exits when they do.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time

from moe_runtime.security.control_key import ControlKey
from moe_runtime.attention_dp.control_plane import ControlAddress, heartbeat_timeout_from_env
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.processes.launcher import main_module_hidden, worker_context
from moe_runtime.processes.worker import worker_main

logger = logging.getLogger(__name__)


def run_worker_node(config: EngineConfig) -> int:
    """Start this node's ranks of `config`'s layout and wait for them; 0 once all exited cleanly."""
    control_port = config.control_port or config.master_port + 1   # as the front picks it (multi-node)
    address = ControlAddress.tcp(config.master_addr, control_port, ControlKey.shared(config.control_key_file),
                                 config.control_heartbeat_timeout_ms(heartbeat_timeout_from_env))
    ranks_per_node = config.world_size // config.nnodes
    first = config.node_rank * ranks_per_node
    context = worker_context()
    processes: list[mp.Process] = []
    for rank in range(first, first + ranks_per_node):
        process = context.Process(target=worker_main, args=(address, rank), name=f"moe-worker-{rank}")
        with main_module_hidden():
            process.start()
        processes.append(process)
    logger.info("node %d: started ranks %d..%d, front at %s:%d", config.node_rank, first, first + ranks_per_node - 1,
                config.master_addr, control_port)
    try:
        while any(p.is_alive() for p in processes):
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if failed:
                logger.error("rank process %s exited with %s; stopping this node", failed[0].name, failed[0].exitcode)
                break
            time.sleep(0.5)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=5)
    return 0 if all(p.exitcode == 0 for p in processes) else 1
