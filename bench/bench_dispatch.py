"""Dispatch + combine latency and bandwidth per backend on gloo ranks of this machine.

For every expert-parallel size, hidden size and token count, times one dispatch + combine
(identity experts) for:
- all_to_all             (send-once: a token goes to each destination rank once)
- all_to_all_per_pair    (the same without dedup: one row per routed (token, k) pair), the
                         baseline that shows what send-once saves
- allgather              (every rank gets every token)
beside a same-process memcpy of the same number of bytes (the loopback ceiling here).

Reports bytes sent per token (per rank, dispatch + combine, metadata included; "remote" counts
only bytes to other ranks), the achieved GB/s of remote bytes, the latency as a multiple of a
memcpy of the same bytes, and the share of bytes send-once dedup saves. Latency is the slowest
rank's; the variants run interleaved in three rounds on the same inputs and each keeps its
best round (the machine is shared, and a load burst should not land on one variant only). Identity experts: the time is
communication plus the dispatcher's own CPU work (packing, grouping, weighted reduction). Prints a table
and writes bench/results/dispatch.json.

    python bench/bench_dispatch.py            # full sweep (~3-6 minutes on 2 busy cores)
    python bench/bench_dispatch.py --quick    # a small sweep for a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the multi-rank harness lives with the tests

from multirank import RankPool  # noqa: E402

VARIANTS = {  # name -> (backend, send_once)
    "all_to_all": ("all_to_all", True),
    "all_to_all_per_pair": ("all_to_all", False),
    "allgather": ("allgather", True),
}


@dataclasses.dataclass
class Shape:
    ep: int
    hidden: int
    tokens: int
    top_k: int
    num_slots: int
    dtype: str


ROUNDS = 3  # timed rounds per shape; variants are interleaved within a round


def _measure_on_rank(shape: Shape, target_s: float) -> dict:
    """Runs on every rank: time dispatch + combine of every variant on the same inputs.

    Variants are interleaved round by round and each keeps its best round, so a burst of load
    from other processes on this shared machine does not land on one variant only.
    Returns {variant: {latency_s, iters, **DispatchStats of this rank}}.
    """
    import torch.distributed as dist

    from moe_runtime.dispatch import DispatchConfig, make_dispatcher
    from moe_runtime.load_balancer import SlotGeometry

    rank = dist.get_rank()
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(dtype)            # [T, H]
    scores = torch.rand(shape.tokens, shape.num_slots, generator=gen)
    slot_ids = scores.topk(shape.top_k, dim=1).indices                               # [T, K]
    weights = torch.softmax(scores.gather(1, slot_ids), dim=1)                       # [T, K]
    dispatchers = {
        name: make_dispatcher(DispatchConfig(backend, SlotGeometry(shape.num_slots, shape.ep), rank, None,
                                             shape.hidden, dtype, send_once=send_once))
        for name, (backend, send_once) in VARIANTS.items()
    }

    def timed(dispatcher, iters: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            out = dispatcher.dispatch(x, slot_ids, weights)
            dispatcher.combine(out.recv_x, out.handle)  # identity experts
        elapsed = torch.tensor([(time.perf_counter() - start) / iters])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        return float(elapsed)

    iters = {}
    for name, dispatcher in dispatchers.items():
        timed(dispatcher, 1)  # warm-up
        probe = timed(dispatcher, 1)
        iters[name] = max(2, min(50, math.ceil(target_s / ROUNDS / max(probe, 1e-6))))
    best = {name: math.inf for name in dispatchers}
    for _ in range(ROUNDS):
        for name, dispatcher in dispatchers.items():
            best[name] = min(best[name], timed(dispatcher, iters[name]))
    return {name: {"latency_s": best[name], "iters": iters[name],
                   **dataclasses.asdict(dispatchers[name].last_stats)} for name in dispatchers}


def memcpy_seconds(num_bytes: int, target_s: float = 0.1) -> float:
    """Single-thread same-process copy of num_bytes (the loopback ceiling on this machine)."""
    num_bytes = max(num_bytes, 1)
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    iters, elapsed = 1, 0.0
    while elapsed < target_s and iters < 1 << 16:
        iters *= 4
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        elapsed = time.perf_counter() - start
    return elapsed / iters


def summarize(shape: Shape, variant: str, per_rank: list[dict]) -> dict:
    latency = per_rank[0]["latency_s"]
    sent = sum(r["dispatch_bytes"] + r["combine_bytes"] for r in per_rank) / shape.ep
    remote = sum(r["remote_bytes"] for r in per_rank) / shape.ep
    saved = sum(r["bytes_saved_by_dedup"] for r in per_rank) / shape.ep
    pairs = sum(r["pairs_routed"] for r in per_rank) / shape.ep
    rows = sum(r["rows_sent"] for r in per_rank) / shape.ep
    copy_s = memcpy_seconds(int(sent))
    return {
        **dataclasses.asdict(shape), "variant": variant, "latency_ms": latency * 1e3,
        "iters": per_rank[0]["iters"],
        "bytes_sent_per_rank": sent, "bytes_per_token": sent / max(shape.tokens, 1),
        "remote_bytes_per_rank": remote, "remote_bytes_per_token": remote / max(shape.tokens, 1),
        "remote_gb_per_s": remote / latency / 1e9,
        "rows_sent_per_rank": rows, "pairs_routed_per_rank": pairs,
        "bytes_saved_by_dedup_per_rank": saved,
        "dedup_saved_fraction": saved / (sent + saved) if sent + saved else 0.0,
        "memcpy_ms_same_bytes": copy_s * 1e3, "memcpy_gb_per_s": sent / copy_s / 1e9,
        "latency_vs_memcpy": latency / copy_s,
    }


def sweep(quick: bool) -> list[Shape]:
    top_k, num_slots, dtype = 8, 64, "bfloat16"
    if quick:
        return [Shape(2, 256, t, top_k, num_slots, dtype) for t in (1, 64)]
    shapes = []
    for ep in (2, 4):
        shapes += [Shape(ep, 1024, t, top_k, num_slots, dtype) for t in (1, 16, 128, 1024, 4096)]
        shapes += [Shape(ep, 4096, t, top_k, num_slots, dtype) for t in (1, 16, 128)]
    return shapes


def print_table(rows: list[dict]) -> None:
    header = (f"{'ep':>2} {'H':>5} {'T':>5} {'backend':<20} {'ms':>8} {'B/token':>8} "
              f"{'remote B/tok':>12} {'remote GB/s':>11} {'memcpy ms':>9} {'x memcpy':>8} "
              f"{'dedup saved':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['ep']:>2} {r['hidden']:>5} {r['tokens']:>5} {r['variant']:<20} "
              f"{r['latency_ms']:>8.3f} {r['bytes_per_token']:>8.0f} "
              f"{r['remote_bytes_per_token']:>12.0f} "
              f"{r['remote_gb_per_s']:>11.3f} {r['memcpy_ms_same_bytes']:>9.3f} "
              f"{r['latency_vs_memcpy']:>8.1f} {100 * r['dedup_saved_fraction']:>10.1f}%")


def ratios(rows: list[dict]) -> list[dict]:
    """Per shape: send-once vs per-pair all-to-all, and all-to-all vs all-gather."""
    by_shape: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_shape.setdefault((r["ep"], r["hidden"], r["tokens"]), {})[r["variant"]] = r
    out = []
    for (ep, hidden, tokens), v in by_shape.items():
        a2a, pair, ag = v.get("all_to_all"), v.get("all_to_all_per_pair"), v.get("allgather")
        if not (a2a and pair and ag):
            continue
        out.append({
            "ep": ep, "hidden": hidden, "tokens": tokens,
            "per_pair_over_send_once_latency": pair["latency_ms"] / a2a["latency_ms"],
            "per_pair_over_send_once_bytes": pair["bytes_sent_per_rank"] / a2a["bytes_sent_per_rank"],
            "allgather_over_all_to_all_latency": ag["latency_ms"] / a2a["latency_ms"],
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sweep (smoke test)")
    parser.add_argument("--target-s", type=float, default=0.6,
                        help="approximate seconds of timed steps per variant and shape")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dispatch.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    load_at_start = os.getloadavg()
    shapes = sweep(args.quick)
    total = len(shapes) * len(VARIANTS)
    rows, done, started = [], 0, time.monotonic()
    for ep in sorted({s.ep for s in shapes}):
        with RankPool(ep, call_timeout_s=300) as pool:
            for shape in (s for s in shapes if s.ep == ep):
                per_rank = pool.run(_measure_on_rank, shape, args.target_s)
                for variant in VARIANTS:
                    rows.append(summarize(shape, variant, [r[variant] for r in per_rank]))
                    done += 1
                    print(f"[{done}/{total} {time.monotonic() - started:5.0f}s] ep={ep} "
                          f"H={shape.hidden} T={shape.tokens} {variant}: "
                          f"{rows[-1]['latency_ms']:.3f} ms", file=sys.stderr, flush=True)
    print_table(rows)
    comparisons = ratios(rows)
    print("\nratios per shape (>1 means the send-once all_to_all wins)")
    for c in comparisons:
        print(f"ep={c['ep']} H={c['hidden']:>4} T={c['tokens']:>4}: "
              f"per-pair/send-once latency {c['per_pair_over_send_once_latency']:.2f}x, "
              f"bytes {c['per_pair_over_send_once_bytes']:.2f}x; "
              f"allgather/all_to_all latency {c['allgather_over_all_to_all_latency']:.2f}x")
    result = {
        "benchmark": "dispatch",
        "description": "dispatch + combine (identity experts) on gloo CPU ranks, one machine",
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load_at_start,
                    "platform": platform.platform(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "settings": {"top_k": 8, "num_slots": 64, "dtype": "bfloat16", "routing": "uniform random",
                     "quick": args.quick, "target_s": args.target_s,
                     "rounds": ROUNDS},
        "notes": "bytes are per rank and include rows a rank sends to itself; remote GB/s counts "
                 "only bytes to other ranks; memcpy is a single-thread copy of the same bytes "
                 "in one process (the loopback ceiling).",
        "rows": rows,
        "ratios": comparisons,
        "wall_s": time.monotonic() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
