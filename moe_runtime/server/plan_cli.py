"""`moe-serve plan`: which layout and how many GPUs for this model and this traffic, and why.

    moe-serve plan --model tests/plan_configs/llama-3.1-70b.json --gpu h100 --gpus-per-node 8 \\
        --prompt-len 2048 --output-len 512 --qps 4 --ttft-ms 2000 --itl-ms 50

    moe-serve plan --gpu cpu --calibrate     # measure this machine once (about a minute), for `--gpu cpu`

Reads only config.json (no torch, no weights): answers in well under a second. docs/planning.md explains
the arithmetic and how far to trust it. Only `--calibrate` measures (it runs engines on every core).
"""
from __future__ import annotations

import argparse
import json
import sys

from moe_runtime.config.engine_config import DTYPES, QUANTIZATIONS
from moe_runtime.errors import MoERuntimeError
from moe_runtime.planner.calibration.cpu_calibration import CACHE, cached_calibration, cpu_hardware
from moe_runtime.planner.hardware import resolve_hardware
from moe_runtime.planner.memory import ModelFootprint, resolve_precision
from moe_runtime.planner.model_shape import load_model_shape
from moe_runtime.planner.plan import Plan, PlanRequest, make_plan
from moe_runtime.planner.plan_report import explain, table
from moe_runtime.planner.serving import Workload
from moe_runtime.server.flag_help import DefaultsHelpFormatter
from moe_runtime.server.flag_types import parse_size, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-serve plan", formatter_class=DefaultsHelpFormatter,
                                description="Rank every parallel layout the runtime can run for a model on the "
                                            "given GPUs: weights and KV per rank, KV capacity, roofline TTFT / ITL "
                                            "/ tokens per GPU, each with its moe-serve command.")
    p.add_argument("--model", help="HF checkpoint directory or its config.json (required but with --calibrate)")
    p.add_argument("--gpu", required=True,
                   help="h100, h200, b200, mi300x, cpu (this machine, from its calibration: --calibrate) or a JSON "
                        "file of moe_runtime.planner.hardware.Hardware fields")
    p.add_argument("--calibrate", action="store_true",
                   help="with --gpu cpu: measure this machine's costs now (about a minute on two cores, engines on "
                        f"every core: not while serving) into {CACHE}; then plan if --model is given")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs in one node (the NVLink domain)")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--prompt-len", type=positive_int, help="required but with --calibrate alone")
    p.add_argument("--output-len", type=positive_int, help="required but with --calibrate alone")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--qps", type=float, help="requests per second to serve: the planner finds the fewest GPUs")
    load.add_argument("--concurrency", type=positive_int,
                      help="requests in flight on all the GPUs: the planner finds the most tokens/s per GPU")
    p.add_argument("--ttft-ms", type=float, help="time-to-first-token SLO")
    p.add_argument("--itl-ms", type=float, help="inter-token latency SLO")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)], help="auto = the checkpoint's")
    p.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q])
    p.add_argument("--kv-cache-memory", type=parse_size,
                   help="KV cache per rank; default: the GPU's memory less weights and a 10%% reserve")
    p.add_argument("--kv-host-memory", type=parse_size, default=0,
                   help="host memory per rank for KV evicted from the device (moe-serve's tier 1): the plan shows the "
                        "tokens of evicted prefixes it keeps beside the device's KV tokens")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=4096)
    p.add_argument("--top", type=positive_int, default=15, help="rows of the table (--json has them all)")
    p.add_argument("--json", action="store_true", help="the whole ranking as JSON")
    return p


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    if args.qps is not None and not args.qps > 0:
        raise MoERuntimeError(f"--qps {args.qps}: must be > 0")
    shape = load_model_shape(args.model)
    workload = Workload(args.prompt_len, args.output_len, args.qps, args.concurrency, args.ttft_ms, args.itl_ms,
                        args.max_num_batched_tokens)
    return PlanRequest(args.model, shape, resolve_hardware(args.gpu, cpu_hardware), args.gpus_per_node, args.nodes, workload,
                       resolve_precision(shape, args.dtype, args.quantization), kv_cache_memory=args.kv_cache_memory,
                       kv_host_memory=args.kv_host_memory)


def plan_json(plan: Plan) -> dict:
    r = plan.request
    footprint = ModelFootprint.of(r.shape, r.precision)
    return {"model": r.model, "architecture": r.shape.architecture, "gpu": r.hardware.name,
            "weight_bytes": footprint.weight_bytes, "kv_bytes_per_token": footprint.kv_bytes_per_token,
            "windowed_kv_bytes_per_token": footprint.windowed_kv_bytes_per_token,
            "gpus": r.total_gpus, "workload": vars(r.workload), "dtype": r.precision.dtype,
            "quantization": r.precision.quantization, "kv_host_memory": r.kv_host_memory,
            "params_b": r.shape.total_params / 1e9, "active_params_b": r.shape.active_params / 1e9,
            "explanation": explain(plan), "rows": [row.as_json() for row in plan.rows]}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.calibrate:
        if args.gpu != "cpu":
            parser.error("--calibrate measures this machine: it goes with --gpu cpu")
        rates, _ = cached_calibration(refresh=True)
        print(f"moe-serve plan: calibrated {rates.host} ({rates.cores} cores): copy {rates.copy_bytes_s / 1e9:.1f} "
              f"GB/s, matmul {rates.matmul_flops / 1e9:.1f} GFLOP/s per core; saved in {CACHE}", file=sys.stderr)
        if args.model is None:
            return 0
    missing = [flag for flag, value in (("--model", args.model), ("--prompt-len", args.prompt_len),
                                        ("--output-len", args.output_len)) if value is None]
    if args.qps is None and args.concurrency is None:
        missing.append("one of --qps, --concurrency")
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    try:
        plan = make_plan(request_from_args(args))
    except (MoERuntimeError, OSError, KeyError, json.JSONDecodeError) as exc:
        parser.exit(2, f"moe-serve plan: error: {exc}\n")
    if args.json:
        print(json.dumps(plan_json(plan), indent=1, default=str))
    else:
        print(table(plan, args.top))
        print()
        print(explain(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
