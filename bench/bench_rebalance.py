"""Rebalancing quality and migration cost: static vs EPLB vs load_balancer.rebalance.

For each trace and layout, every method starts from the static placement and
is rebalanced once per round on the load of the round just finished:
  before  balancedness of the placement in force on that load
  after   balancedness of the new placement on the same load (fit)
  next    balancedness of the new placement on the next round's load (what it serves)
  moved   expert weights rewritten per rebalance, all layers (moved>1: rounds after the
          first, which starts from the static placement)
  coloc   replicas sharing a rank with a replica of the same expert
Balancedness = mean / max of per-rank load per layer, averaged over layers and
rounds (1.0 = perfect). Methods: static (never moves), eplb (bench/eplb_reference.py),
"rebalance (no prev)" (recomputed from scratch each round), "rebalance (gain=0)"
(previous given, any gain taken), "rebalance (noise=.1)" (load_noise=0.1, a
placement robust to 10% load shifts), and "rebalance" with its defaults. Traces: stationary Zipf loads (s = 0.8, 1.2, 1.5), a hot
set drifting over many rounds, Zipf(1.5) on 64 experts / 8 ranks x 9 slots (the
case where rebalance once fell below EPLB), and bench/traces/recorded.json when present.
Also measures ExpertLoadRecorder's cost per step against a naive recorder.

    python bench/bench_rebalance.py            # full run, writes bench/results/rebalance.json
    python bench/bench_rebalance.py --quick    # small smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.eplb_reference import eplb_rebalance  # noqa: E402
from moe_runtime.load_balancer import (  # noqa: E402
                DEFAULT_GAIN_PER_COPY_ROUND,
                ExpertLoadRecorder,
                Placement,
                balancedness,
                load_trace,
                rebalance,
                static_placement,
            )

ROOT = Path(__file__).resolve().parents[1]
RECORDED_TRACE = ROOT / "bench" / "traces" / "recorded.json"


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    experts: int
    slots: int
    ranks: int
    nodes: int
    groups: int | None  # None: global placement; else hierarchical (groups kept within a node)


@dataclass
class Row:
    trace: str
    layout: str
    method: str
    rounds: int
    before: float
    after: float
    next: float
    moved_per_rebalance: float
    moved_after_first: float  # mean over rebalances after the first (which starts from static)
    colocated_per_rebalance: float
    seconds_per_rebalance: float


# --------------------------------------------------------------------------- traces


def zipf_probs(experts: int, exponent: float, layers: int, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.arange(1, experts + 1, dtype=torch.float64)
    weights = ranks**-exponent
    return torch.stack([weights[torch.randperm(experts, generator=generator)] for _ in range(layers)])


def sample_load(probs: torch.Tensor, tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """[L, E] tokens per expert: `tokens` tokens each choosing `top_k` experts by `probs`."""
    draws = torch.multinomial(probs / probs.sum(-1, keepdim=True), tokens * top_k, replacement=True, generator=generator)
    return torch.zeros_like(probs).scatter_add_(1, draws, torch.ones_like(draws, dtype=probs.dtype))


def zipf_trace(experts, layers, exponent, rounds, tokens, seed) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    probs = zipf_probs(experts, exponent, layers, generator)
    return [sample_load(probs, tokens, 8, generator) for _ in range(rounds + 1)]


def drifting_trace(experts, layers, rounds, tokens, seed, step_sigma=0.15) -> list[torch.Tensor]:
    """Zipf(1.0) popularity whose log-weights random-walk (sigma per round): the hot set drifts."""
    generator = torch.Generator().manual_seed(seed)
    log_weights = zipf_probs(experts, 1.0, layers, generator).log()
    loads = []
    for _ in range(rounds + 1):
        loads.append(sample_load(log_weights.exp(), tokens, 8, generator))
        log_weights += step_sigma * torch.randn(log_weights.shape, generator=generator, dtype=torch.float64)
    return loads


def recorded_rounds(rounds: int) -> tuple[list[torch.Tensor], int, int] | None:
    if not RECORDED_TRACE.exists():
        return None
    trace = load_trace(RECORDED_TRACE)
    per_round = max(1, trace.steps.shape[0] // (rounds + 1))
    chunks = trace.steps.split(per_round)[: rounds + 1]
    return [chunk.sum(0).double() for chunk in chunks], trace.num_slots, trace.num_ranks


# --------------------------------------------------------------------------- methods


def run_method(method: str, loads: list[torch.Tensor], layout: LayoutSpec, min_gain: float) -> Row | None:
    layers = loads[0].shape[0]
    placement = static_placement(layers, layout.experts, layout.slots, layout.ranks, layout.nodes)
    before, after, nxt, moved, coloc, seconds = [], [], [], [], [], []
    for round_index in range(len(loads) - 1):
        load, upcoming = loads[round_index], loads[round_index + 1]
        before.append(float(balancedness(load, placement).mean()))
        start = time.perf_counter()
        if method == "static":
            new = placement
        elif method == "eplb":
            phy2log = eplb_rebalance(load, layout.slots, layout.ranks, layout.nodes, layout.groups)
            new = Placement.from_phy2log(phy2log, layout.experts, layout.ranks, layout.nodes, check=False)
        elif method == "rebalance (no prev)":
            new = rebalance(load, layout.slots, layout.ranks, layout.nodes, num_groups=layout.groups)
        else:
            gain = 0.0 if method == "rebalance (gain=0)" else min_gain
            noise = 0.1 if method == "rebalance (noise=.1)" else 0.0
            new = rebalance(
                load, layout.slots, layout.ranks, layout.nodes,
                previous=placement, num_groups=layout.groups, min_gain_per_move=gain, load_noise=noise,
            )
        seconds.append(time.perf_counter() - start)
        after.append(float(balancedness(load, new).mean()))
        nxt.append(float(balancedness(upcoming, new).mean()))
        moved.append(int((new.phy2log != placement.phy2log).sum()))
        coloc.append(int(new.colocated_replicas().sum()))
        placement = new
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    steady = mean(moved[1:]) if len(moved) > 1 else float("nan")
    return Row(
        "", layout.name, method, len(before), mean(before), mean(after), mean(nxt),
        mean(moved), steady, mean(coloc), mean(seconds),
    )


# --------------------------------------------------------------------------- recorder overhead


def recorder_overhead(layers: int, experts: int, slots: int, tokens: int, top_k: int, steps: int) -> dict:
    ids = [torch.randint(0, experts, (tokens, top_k)) for _ in range(layers)]
    slot_ids = [torch.randint(0, slots, (tokens, top_k)) for _ in range(layers)]
    recorder = ExpertLoadRecorder(layers, experts, slots, 8, window=64)

    def ours(with_slots: bool):
        for layer in range(layers):
            recorder.record(layer, ids[layer], slot_ids[layer] if with_slots else None)
        recorder.end_step()

    naive_counts = [[0] * experts for _ in range(layers)]

    def naive():  # what one would write first: bincount + host copy per layer
        for layer in range(layers):
            counts = torch.bincount(ids[layer].flatten(), minlength=experts).tolist()
            row = naive_counts[layer]
            for expert, count in enumerate(counts):
                row[expert] += count

    def per_step(fn, *args):
        for _ in range(3):
            fn(*args)
        start = time.perf_counter()
        for _ in range(steps):
            fn(*args)
        return (time.perf_counter() - start) / steps * 1e6

    result = {
        "layers": layers, "experts": experts, "tokens": tokens, "top_k": top_k, "device": "cpu",
        "ours_us_per_step": per_step(ours, False),
        "ours_with_slots_us_per_step": per_step(ours, True),
        "naive_bincount_tolist_us_per_step": per_step(naive),
    }
    result["naive_over_ours"] = result["naive_bincount_tolist_us_per_step"] / result["ours_us_per_step"]
    return result


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few layers and rounds (smoke run)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="rebalance rounds on stationary traces")
    parser.add_argument("--drift-rounds", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per round (top-8 each)")
    parser.add_argument("--min-gain-per-move", type=float, default=None,
                        help="rebalance's threshold (default: its own, DEFAULT_GAIN_PER_COPY_ROUND / ranks)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "rebalance.json"))
    args = parser.parse_args()
    if args.quick:
        args.layers, args.rounds, args.drift_rounds = 2, 2, 4
    torch.set_num_threads(1)
    min_gain = args.min_gain_per_move  # None: rebalance's default, scaled by 1 / ranks
    layouts = [
        LayoutSpec("64e/80s/8r/2n global", 64, 80, 8, 2, None),
        LayoutSpec("64e/80s/8r/2n 8grp", 64, 80, 8, 2, 8),
        LayoutSpec("256e/288s/32r/4n global", 256, 288, 32, 4, None),
        LayoutSpec("256e/288s/32r/4n 8grp", 256, 288, 32, 4, 8),
    ]
    methods = ["static", "eplb", "rebalance (no prev)", "rebalance (gain=0)", "rebalance (noise=.1)", "rebalance"]
    rows: list[Row] = []
    notes: list[str] = []

    def bench_trace(name, loads, layout):
        for method in methods:
            row = run_method(method, loads, layout, min_gain)
            row.trace = name
            rows.append(row)
            print(_format(row), flush=True)

    print(_header(), flush=True)
    for index, layout in enumerate(layouts):
        seed = 1000 * index
        for exponent in (0.8, 1.2, 1.5):
            loads = zipf_trace(layout.experts, args.layers, exponent, args.rounds, args.tokens, seed + int(exponent * 10))
            bench_trace(f"zipf s={exponent}", loads, layout)
        loads = drifting_trace(layout.experts, args.layers, args.drift_rounds, args.tokens, seed + 7)
        bench_trace("drifting hot set", loads, layout)
    # The case where rebalance once fell below EPLB: Zipf(1.5), 64 experts on 8 ranks x 9 slots.
    zipf_8x9_layout = LayoutSpec("64e/72s/8r global", 64, 72, 8, 1, None)
    loads = zipf_trace(zipf_8x9_layout.experts, args.layers, 1.5, args.rounds, args.tokens, 15)
    bench_trace("zipf s=1.5 8x9", loads, zipf_8x9_layout)
    recorded = recorded_rounds(args.rounds)
    if recorded is None:
        notes.append(f"{RECORDED_TRACE.relative_to(ROOT)} absent: recorded-trace rows skipped")
        print(f"note: {notes[-1]}")
    else:
        loads, slots, ranks = recorded
        experts = loads[0].shape[1]
        layout = LayoutSpec(f"recorded {experts}e/{slots}s/{ranks}r", experts, slots, ranks, 1, None)
        bench_trace("recorded", loads, layout)

    overhead = recorder_overhead(layers=16, experts=256, slots=288, tokens=512, top_k=8, steps=50 if not args.quick else 5)
    print(
        f"\nrecorder, {overhead['layers']} layers x {overhead['tokens']} tokens x top-{overhead['top_k']} (CPU): "
        f"{overhead['ours_us_per_step']:.0f} us/step ({overhead['ours_with_slots_us_per_step']:.0f} with slots), "
        f"naive bincount+tolist {overhead['naive_bincount_tolist_us_per_step']:.0f} us/step "
        f"({overhead['naive_over_ours']:.1f}x ours)"
    )
    summary = _summary(rows)
    for line in summary["lines"]:
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": {**vars(args), "gain_per_copy_round": DEFAULT_GAIN_PER_COPY_ROUND},
        "rows": [asdict(row) for row in rows],
        "summary": summary,
        "recorder_overhead": overhead,
        "notes": notes,
    }, indent=1))
    print(f"wrote {out}")


def _summary(rows: list[Row]) -> dict:
    by_key = {(r.trace, r.layout, r.method): r for r in rows}
    lines, pairs = [], []
    for method in ("rebalance (gain=0)", "rebalance"):
        lines += ["", f"{method} vs eplb, ours/eplb (same trace, layout, slot count; moved>1 = after the first round):"]
        for (trace, layout, name), ours in by_key.items():
            if name != method:
                continue
            eplb = by_key[(trace, layout, "eplb")]
            pair = {
                "method": method, "trace": trace, "layout": layout,
                "after_ours": ours.after, "after_eplb": eplb.after,
                "next_ours": ours.next, "next_eplb": eplb.next,
                "moved_ours": ours.moved_per_rebalance, "moved_eplb": eplb.moved_per_rebalance,
                "moved_after_first_ours": ours.moved_after_first, "moved_after_first_eplb": eplb.moved_after_first,
                "moved_after_first_ratio_eplb_over_ours": eplb.moved_after_first / max(ours.moved_after_first, 1e-9),
                "colocated_eplb": eplb.colocated_per_rebalance,
            }
            pairs.append(pair)
            lines.append(
                f"  {trace:16s} {layout:24s} after {ours.after:.3f}/{eplb.after:.3f} ({ours.after / eplb.after:.3f}x) "
                f"next {ours.next:.3f}/{eplb.next:.3f} ({ours.next / eplb.next:.3f}x) "
                f"moved>1 {ours.moved_after_first:6.1f}/{eplb.moved_after_first:6.1f} "
                f"({pair['moved_after_first_ratio_eplb_over_ours']:.1f}x fewer), eplb co-located {eplb.colocated_per_rebalance:.1f}"
            )
    return {"pairs": pairs, "lines": lines}


def _header() -> str:
    return (
        f"{'trace':18s} {'layout':26s} {'method':19s} {'rounds':>6s} {'before':>7s} {'after':>7s} "
        f"{'next':>7s} {'moved':>8s} {'moved>1':>8s} {'coloc':>6s} {'s/rebal':>8s}"
    )


def _format(row: Row) -> str:
    return (
        f"{row.trace:18s} {row.layout:26s} {row.method:19s} {row.rounds:6d} {row.before:7.3f} {row.after:7.3f} "
        f"{row.next:7.3f} {row.moved_per_rebalance:8.1f} {row.moved_after_first:8.1f} {row.colocated_per_rebalance:6.1f} {row.seconds_per_rebalance:8.2f}"
    )


if __name__ == "__main__":
    main()
