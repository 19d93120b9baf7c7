"""What the runtime's collectives really cost between two rank processes of this machine, measured.

The ranks of a CPU job are processes on one host talking over gloo (loopback TCP); a multi-rank step also
pays the lock-step loop's control traffic (a small all-reduce agreeing on commands and work, the front's
command and result messages) and, on a machine with few cores, ranks that share cores with each other and
with the front. None of that follows from a bandwidth figure, so two spawned processes (one thread each,
as a rank runs) time, median of many:
  - all_reduce and all_to_all_single of float32 tensors from 2 KiB to 1 MiB: a latency (the smallest) and
    a bandwidth (the slope between the smallest and the largest),
  - the control all-reduce (3 int64) and a message round trip to the parent (the front's pipe),
  - a fixed loop of small matmuls alone and with the other rank running it too: how much slower a rank
    computes when both ranks compute at once (`shared_slowdown`, 1.0 on a machine with cores to spare).
"""
from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass

SIZES = (2 * 2**10, 16 * 2**10, 128 * 2**10, 2**20)   # bytes per rank
REPEATS = 60


@dataclass(frozen=True)
class CollectiveCosts:
    all_reduce_latency_s: float
    all_reduce_bytes_s: float       # payload bytes per second past the latency
    all_to_all_latency_s: float
    all_to_all_bytes_s: float
    control_s: float                # the lock-step control all-reduce (3 int64)
    front_round_trip_s: float       # one small message to the front and back
    shared_slowdown: float          # a rank's compute time with both ranks computing, over alone


def measure_collectives(timeout_s: float = 120.0) -> CollectiveCosts:
    """Spawn two gloo ranks, time their collectives (see the module's docstring), return the fitted costs."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    parent_ends, procs = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(rank, port, child), daemon=True)
        proc.start()
        parent_ends.append(parent)
        procs.append(proc)
    try:
        front = parent_ends[0]
        if not front.poll(timeout_s):
            raise RuntimeError("collective calibration: rank 0 did not start")
        assert front.recv() == "ready"
        trips = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            front.send(("ping", None))
            front.recv()
            trips.append(time.perf_counter() - started)
        front.send(("measure", None))
        for end in parent_ends[1:]:
            end.send(("measure", None))
        if not front.poll(timeout_s):
            raise RuntimeError("collective calibration: no result from rank 0")
        timings = front.recv()
    finally:
        for end in parent_ends:
            try:
                end.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return _fit(timings, statistics.median(trips))


def _fit(timings: dict, round_trip: float) -> CollectiveCosts:
    def line(kind: str) -> tuple[float, float]:
        small, large = timings[kind][SIZES[0]], timings[kind][SIZES[-1]]
        return small, (SIZES[-1] - SIZES[0]) / max(large - small, 1e-9)

    ar_latency, ar_rate = line("all_reduce")
    a2a_latency, a2a_rate = line("all_to_all")
    return CollectiveCosts(ar_latency, ar_rate, a2a_latency, a2a_rate, timings["control"], round_trip,
                           max(timings["together"] / timings["alone"], 1.0))


def _rank_main(rank: int, port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            conn.send("ready")
        while True:
            command, _ = conn.recv()
            if command == "ping":
                conn.send("pong")
            elif command == "measure":
                timings = _timings(rank)
                if rank == 0:
                    conn.send(timings)
            elif command == "stop":
                return
    finally:
        dist.destroy_process_group()


def _timings(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    world = dist.group.WORLD   # the measurement's own two-process group, named as every collective here names one

    def median(fn) -> float:
        samples = []
        for _ in range(REPEATS):
            dist.barrier(group=world)
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    timings = {"all_reduce": {}, "all_to_all": {}}
    for size in SIZES:
        x = torch.ones(size // 4)
        out = torch.empty_like(x)
        timings["all_reduce"][size] = median(lambda: dist.all_reduce(x, group=world))
        timings["all_to_all"][size] = median(lambda: dist.all_to_all_single(out, x, group=world))
    flags = torch.zeros(3, dtype=torch.int64)
    timings["control"] = median(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=world))
    a, w = torch.randn(1, 512), torch.randn(512, 512)
    work = lambda: [a @ w for _ in range(1000)]   # noqa: E731
    work()
    dist.barrier(group=world)
    if rank == 0:   # alone: the other rank sleeps (a rank blocked in gloo might spin)
        alone = statistics.median(_timed(work) for _ in range(9))
    else:
        time.sleep(1.0)
    dist.barrier(group=world)
    together = statistics.median(_timed(work) for _ in range(9))
    timings["alone"], timings["together"] = (alone if rank == 0 else 0.0), together
    return timings


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
