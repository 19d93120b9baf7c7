"""What a pipeline hop costs between two rank processes of this machine: gloo point to point, measured bare.

A pipeline stage sends its micro-batch's hidden states to the next (`execution/pipeline.py`: isend / recv on the
pipeline group). Two spawned processes (one thread each, as a rank runs) time ping-pongs of float32 tensors
from 2 KiB to 1 MiB, median of many; half a round trip is one hop: a latency (the smallest) and a bandwidth
(the slope between the smallest and the largest). The collectives of expert and tensor parallelism are not
measured bare: inside a running job they cost far more than between two idle processes
(`cpu_engine_collectives.py` measures them there).
"""
from __future__ import annotations

import socket
import statistics
import time

from moe_runtime.planner.cpu_overheads import Line

SIZES = (2 * 2**10, 16 * 2**10, 128 * 2**10, 2**20)   # bytes per hop
REPEATS = 60


def measure_pipeline_hop(timeout_s: float = 120.0) -> Line:
    """Spawn two gloo ranks, time their ping-pongs (see the module's docstring): seconds per hop against bytes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, child if rank == 0 else None), daemon=True)
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        if not parent.poll(timeout_s):
            raise RuntimeError("pipeline hop calibration: no result from rank 0")
        hops = parent.recv()
    finally:
        for proc in procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
    small, large = hops[SIZES[0]], hops[SIZES[-1]]
    return Line(small, max(large - small, 0.0) / (SIZES[-1] - SIZES[0]))


def _rank_main(rank: int, port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.group.WORLD   # the measurement's own two-process group, named as every collective here names one
    try:
        hops = {}
        for size in SIZES:
            x = torch.ones(size // 4)
            samples = []
            for _ in range(REPEATS):
                dist.barrier(group=group)
                started = time.perf_counter()
                if rank == 0:
                    dist.send(x, 1, group=group)
                    dist.recv(x, 1, group=group)
                else:
                    dist.recv(x, 0, group=group)
                    dist.send(x, 0, group=group)
                samples.append((time.perf_counter() - started) / 2)
            hops[size] = statistics.median(samples)
        if conn is not None:
            conn.send(hops)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
