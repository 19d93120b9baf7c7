"""Is `moe-serve plan --gpu cpu` right on this machine? Predicted against measured decode tok/s and KV capacity.

Runs a few layouts of the bench checkpoints (the Qwen3-MoE one of bench_offline.py at ep 1, ep 2 with
attention TP 2, ep 2 with dp_attn 2, pp 2; the dense Llama of bench_tp_pp.py at tp 2 and 1 rank), one core
per rank (the planner's `--gpu cpu` unit: one "GPU" is one core), 8 prompts of 32 tokens decoding 32 more,
greedy, the median of 3 decode spans. For each: the planner's decode tok/s at that batch against the measured
one, and its KV capacity (tokens per DP worker at --kv-cache-memory 64M) against the engine's own block count.

The calibration (measured first, under the machine's load of the moment) times the same two shapes at 1 and 8
requests per worker with 16-token prompts, on one rank, at ep 2 with dp_attn 2 and at tp 2: those four rows
are predicted at another batch and context than they were fitted at; "ep2 attn_tp2" (attention all-reduces
inside an expert-parallel worker) and "pp2" (stages and hops) are not fitted to at all ("held_out" in the JSON).
Writes bench/results/plan_calibration.json; exits 1 if a decode error exceeds 30% or a KV capacity differs.

    python bench/bench_plan_calibration.py           # every layout (a few minutes on 2 cores)
    python bench/bench_plan_calibration.py --quick   # the machinery only: ep 1 and pp 2, fewer tokens
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_runtime.config.parallel_layout import ParallelLayout   # noqa: E402
from moe_runtime.planner.calibration.cpu_calibration import cached_calibration, cpu_hardware   # noqa: E402
from moe_runtime.planner.calibration.cpu_engine_collectives import measure_engine_decode   # noqa: E402
from moe_runtime.planner.memory import kv_capacity, rank_memory, resolve_precision   # noqa: E402
from moe_runtime.planner.model_shape import load_model_shape   # noqa: E402
from moe_runtime.planner.roofline import StepModel, Topology   # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KV_MEMORY = 64 * 2**20
DECODE_ERROR_LIMIT = 0.30
MOE_LAYOUTS = {"ep1": {}, "ep2 attn_tp2": dict(ep=2, dp_attn=1), "ep2 dp_attn2": dict(ep=2, dp_attn=2),
               "pp2": dict(pp=2)}
HELD_OUT = ("ep2 attn_tp2", "pp2")   # layouts the calibration never runs
DENSE_LAYOUTS = {"dense 1 rank": {}, "dense tp2": dict(tp=2)}


def predict(path: Path, layout: dict, prompts: int, prompt_len: int, new: int, block_size: int = 16,
            hardware=None) -> dict:
    shape = load_model_shape(path)
    lo = ParallelLayout(**layout)
    precision = resolve_precision(shape, "float32", None)
    memory = rank_memory(shape, lo, precision, block_size)
    capacity = kv_capacity(memory, lo, KV_MEMORY, block_size, prompt_len + new)
    step = StepModel(shape, lo, precision, hardware or cpu_hardware(), Topology(gpus_per_node=2))
    batch = max(prompts // lo.dp_size, 1)
    seconds = step.step_seconds(batch, prompt_len + new / 2, decode=True)
    return dict(decode_tok_s=prompts / seconds, kv_tokens_per_worker=capacity.tokens_per_worker)


def measure(path: Path, layout: dict, prompts: int, prompt_len: int, new: int, repeats: int = 3) -> dict:
    """The runtime's decode tok/s under `layout` (median of `repeats` decode spans) and its KV capacity."""
    dp = layout.get("dp_attn", 1) if layout.get("ep", 1) > 1 else 1
    decode = measure_engine_decode(path, layout, max(prompts // dp, 1), prompt_len, new, repeats,
                                   kv_cache_memory=KV_MEMORY)
    return dict(decode_tok_s=prompts / decode.wall_s, kv_tokens_per_worker=decode.kv_capacity_tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ep 1 and pp 2 only, 4 prompts x 4 new tokens")
    parser.add_argument("--cached", action="store_true",
                        help="use the cached calibration (default: measure it again first, under today's load)")
    args = parser.parse_args()
    rates, overheads = cached_calibration(refresh=not args.cached)
    hardware = cpu_hardware(rates, overheads)
    print(f"calibration: {json.dumps(overheads.as_json() if overheads else None)}", flush=True)
    from bench.bench_offline import build_checkpoint
    from bench.bench_tp_pp import build_checkpoint as build_dense

    prompts, prompt_len, new = (4, 16, 4) if args.quick else (8, 32, 32)
    runs = [(build_checkpoint("float32"), name, layout) for name, layout in MOE_LAYOUTS.items()]
    if args.quick:
        runs = [r for r in runs if r[1] in ("ep1", "pp2")]
    else:
        runs += [(build_dense(), name, layout) for name, layout in DENSE_LAYOUTS.items()]
    rows, failed = [], False
    for path, name, layout in runs:
        predicted = predict(path, layout, prompts, prompt_len, new, hardware=hardware)
        load_before = os.getloadavg()[0]
        measured = measure(path, layout, prompts, prompt_len, new)
        load = (load_before + os.getloadavg()[0]) / 2
        error = predicted["decode_tok_s"] / measured["decode_tok_s"] - 1
        kv_exact = predicted["kv_tokens_per_worker"] == measured["kv_tokens_per_worker"]
        failed |= abs(error) > DECODE_ERROR_LIMIT or not kv_exact
        rows.append(dict(layout=name, **{f"predicted_{k}": v for k, v in predicted.items()},
                         **{f"measured_{k}": v for k, v in measured.items()}, decode_error=error, kv_exact=kv_exact,
                         load_average=load, held_out=name in HELD_OUT))
        print(f"{name:14s} decode tok/s predicted {predicted['decode_tok_s']:8.1f} measured "
              f"{measured['decode_tok_s']:8.1f} error {error:+.0%}   KV tokens/worker predicted "
              f"{predicted['kv_tokens_per_worker']} measured {measured['kv_tokens_per_worker']}"
              f" {'exact' if kv_exact else 'DIFFERS'}   load {load:.1f}", flush=True)
    result = dict(rates=vars(rates), overheads=overheads.as_json() if overheads else None, prompts=prompts,
                  prompt_len=prompt_len, new_tokens=new, kv_cache_memory=KV_MEMORY, rows=rows, passed=not failed)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "plan_calibration.json").write_text(json.dumps(result, indent=1))
    print("calibration", "passed" if not failed else f"FAILED (decode error limit {DECODE_ERROR_LIMIT:.0%}, KV exact)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
