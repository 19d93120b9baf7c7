"""Two-batch overlap (TBO) at ep=2: prefill and decode step time with and without it, and the share of
dispatch + combine time hidden behind compute, measured from per-phase timestamps, in one run.

Two worker ranks (gloo, one intra-op thread each, ep=2 dp_attn=2: each rank its own DP worker, experts split
in two, all_to_all dispatch) each run an `EngineCore` on the Qwen3-MoE bench checkpoint of bench_offline.py
(hidden 512, 8 layers, 32 experts top-4, fp32), stepped directly (no front, no control plane: only the
forward step is timed). Every round, each rank takes the same requests (N prompts of P tokens, its own
token ids, prefix caching off) twice, once per mode, TBO off and on in alternating order: one prefill
step (all N prompts: N x P tokens per rank), then D decode steps (N tokens per rank per step). TBO is
switched by `MoEExecutor.two_batch_overlap` on the same engines, so both modes share weights, caches and
warm-up.

Per mode: step time (the slower rank's, median over rounds), and from every dispatch's and combine's
timestamps (`moe_runtime.moe.comm_timeline`): comm time (start + in flight), the part in flight while the
rank computed (hidden), and what the step waited for (exposed), summed over both ranks. Greedy tokens of
the two modes must be equal. Writes bench/results/tbo.json.

    python bench/bench_tbo.py            # full run (about 2 minutes on 2 cores)
    python bench/bench_tbo.py --quick    # smoke run: 4 prompts x 32 tokens, 4 decode steps, 1 round
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_offline import SHAPE, build_checkpoint
from moe_runtime.processes.distributed import build_parallel_context, free_port, init_distributed
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.moe.comm_timeline import CommTimeline
from moe_runtime.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODES = ("off", "on")
PHASES = ("prefill", "decode")

logger = logging.getLogger("bench_tbo")


def prompts_of(rank: int, count: int, length: int) -> list[list[int]]:
    """Deterministic prompts, different per rank (so the two ranks route differently)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(5, 4000, (count, length), generator=gen).tolist()


def run_mode(core, timeline, tbo: bool, prompts: list[list[int]], decode_steps: int, round_index: int) -> dict:
    """One prefill step and `decode_steps` decode steps of `prompts` with TBO on or off, on this rank."""
    core.executor.two_batch_overlap = tbo
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    ids = [f"r{round_index}-{'on' if tbo else 'off'}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        core.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    record = {"mode": "on" if tbo else "off", "round": round_index}
    control = core.parallel.world_control_group
    for phase, steps in (("prefill", 1), ("decode", decode_steps)):
        dist.barrier(group=control)
        timeline.clear()
        started = time.perf_counter()
        for _ in range(steps):
            for delta in core.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
        elapsed = time.perf_counter() - started
        summary = timeline.summary()
        record[phase] = {"step_s": elapsed / steps, "comm_s": summary.comm_seconds / steps,
                         "hidden_s": summary.hidden_seconds / steps, "exposed_s": summary.exposed_seconds / steps,
                         "transfers_per_step": summary.transfers / steps}
    if core.has_unfinished():
        raise RuntimeError("requests left after the decode steps: the step count is off")
    record["tokens"] = [tokens[i] for i in ids]
    return record


def rank_main(rank: int, port: int, args: argparse.Namespace, path: str, queue) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    try:
        init_distributed(rank, 2, torch.device("cpu"), "env://", "127.0.0.1", port, 600.0)
        config = EngineConfig(model=path, device="cpu", dtype="float32", ep=2, dp_attn=2, enable_prefix_caching=False,
                              max_num_seqs=args.prompts, max_num_batched_tokens=args.prompts * args.prompt_len,
                              kv_cache_memory=512 * 2**20)
        parallel = build_parallel_context(config.layout(), rank, torch.device("cpu"), SHAPE["num_hidden_layers"])
        core = EngineCore(config, parallel)
        timeline = CommTimeline()
        core.executor.trace_comm(timeline)
        prompts = prompts_of(rank, args.prompts, args.prompt_len)
        for tbo in (False, True):   # warm-up, not recorded
            run_mode(core, timeline, tbo, prompts[:2], 2, -1)
        records = []
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for tbo in order:
                records.append(run_mode(core, timeline, tbo, prompts, args.decode_steps, round_index))
        queue.put((rank, records, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
        raise exc


def summarize(per_rank: list[list[dict]]) -> dict:
    """Per phase and mode: the slower rank's step time per round (median, best), comm figures summed over ranks."""
    out = {}
    for phase in PHASES:
        out[phase] = {}
        for mode in MODES:
            rounds = [[r for r in records if r["mode"] == mode] for records in per_rank]   # [rank][round]
            steps = [max(rank_rounds[i][phase]["step_s"] for rank_rounds in rounds) for i in range(len(rounds[0]))]
            total = {key: sum(r[phase][key] for rank_rounds in rounds for r in rank_rounds)
                     for key in ("comm_s", "hidden_s", "exposed_s", "step_s")}
            out[phase][mode] = {
                "step_ms_median": 1e3 * statistics.median(steps), "step_ms_best": 1e3 * min(steps),
                "step_ms_rounds": [round(1e3 * s, 2) for s in steps],
                # per rank and step, averaged over rounds and ranks
                "comm_ms_per_step": 1e3 * total["comm_s"] / len(rounds) / len(rounds[0]),
                "exposed_comm_ms_per_step": 1e3 * total["exposed_s"] / len(rounds) / len(rounds[0]),
                "hidden_share": total["hidden_s"] / total["comm_s"] if total["comm_s"] else 0.0,
                "exposed_share_of_step": total["exposed_s"] / total["step_s"] if total["step_s"] else 0.0,
                "transfers_per_step": rounds[0][0][phase]["transfers_per_step"],
            }
        off, on = out[phase]["off"], out[phase]["on"]
        out[phase]["speedup_median"] = off["step_ms_median"] / on["step_ms_median"]
        out[phase]["speedup_best"] = off["step_ms_best"] / on["step_ms_best"]
    tokens = {mode: [r["tokens"] for records in per_rank for r in records if r["mode"] == mode] for mode in MODES}
    out["tokens_equal"] = tokens["off"] == tokens["on"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="requests per rank (the decode batch per rank)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (prefill: prompts x len per rank)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each running both modes (order alternates)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 x 32 tokens, 4 decode steps, 1 round")
    parser.add_argument("--out", default=str(RESULTS / "tbo.json"))
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.prompt_len, args.decode_steps, args.rounds = 4, 32, 4, 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = str(build_checkpoint("float32"))
    load_before = os.getloadavg()
    started = time.perf_counter()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, port, args, path, queue), daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    per_rank: list = [None, None]
    for _ in procs:
        rank, records, error = queue.get(timeout=1800)
        if error is not None:
            for proc in procs:
                proc.kill()
            raise SystemExit(f"rank {rank} failed:\n{error}")
        per_rank[rank] = records
    for proc in procs:
        proc.join(timeout=60)
    summary = summarize(per_rank)
    result = {
        "command": "python bench/bench_tbo.py" + (" --quick" if args.quick else ""),
        "setup": {"ep": 2, "dp_attn": 2, "a2a_backend": "all_to_all (gloo)", "checkpoint": "bench_offline Qwen3-MoE",
                  "shape": SHAPE, "dtype": "float32", "prompts_per_rank": args.prompts, "prompt_len": args.prompt_len,
                  "prefill_tokens_per_rank": args.prompts * args.prompt_len, "decode_batch_per_rank": args.prompts,
                  "decode_steps": args.decode_steps, "rounds": args.rounds, "threads_per_rank": args.threads},
        "environment": {"cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
                        "torch": torch.__version__, "python": platform.python_version(),
                        "wall_s": round(time.perf_counter() - started, 1)},
        "results": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(summary)
    print(f"\nwrote {args.out}")


def print_table(summary: dict) -> None:
    print(f"\n{'phase':8} {'TBO':4} {'step ms (median/best)':>22} {'d+c ms/step':>12} {'exposed ms':>11} "
          f"{'hidden share':>13} {'exposed/step':>13}")
    for phase in PHASES:
        for mode in MODES:
            row = summary[phase][mode]
            print(f"{phase:8} {mode:4} {row['step_ms_median']:>12.1f} / {row['step_ms_best']:<7.1f} "
                  f"{row['comm_ms_per_step']:>12.2f} {row['exposed_comm_ms_per_step']:>11.2f} "
                  f"{row['hidden_share']:>13.1%} {row['exposed_share_of_step']:>13.1%}")
        print(f"{phase:8} speedup (off / on): median {summary[phase]['speedup_median']:.3f}x, "
              f"best {summary[phase]['speedup_best']:.3f}x")
    print(f"greedy tokens equal with and without TBO: {summary['tokens_equal']}")


if __name__ == "__main__":
    main()
