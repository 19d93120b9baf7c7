"""Context parallelism (cp=2) against one rank (cp=1) and transformers: prefill of 2k and 8k-token prompts,
decode at long context, and what the K/V exchange moves and costs, in one run.

The Qwen3-MoE bench checkpoint of bench_offline.py (hidden 512, 8 layers, 8 heads / 4 KV heads of 64,
32 experts top-4, fp32), with room for 8k-token prompts. Every system gets this machine's 2 cores:

- cp=1: one `EngineCore` in one process with 2 intra-op threads (what `LLM(...)` runs), and the same with
  one thread (a rank's own compute: how cp scales where each rank is its own device, as on GPUs);
- cp=2: two ranks (gloo, one thread each), each an `EngineCore` of the same DP worker, stepped in lock-step;
- transformers: one forward of the prompt (`use_cache=False`, sdpa attention, 2 threads): the prefill a
  user of transformers would wait for.

Engines are stepped directly (no front): a prefill step of one prompt (prefix caching off, one chunk), then
decode steps. Decode runs a batch of 8 sequences whose prompts (2k tokens each) were prefilled first. Step
times are the slower rank's, best of the rounds. The cp=2 ranks count the K/V they exchanged (bytes and
seconds inside the all-gathers) and time the collective a KV cache sharded by sequence would add per layer
at decode (the all-gather of every query's partial output and log-sum-exp), the design this runtime did not
take (docs/design.md, "Context parallelism"). Greedy tokens of cp=1 and cp=2 must be equal.
Writes bench/results/cp.json.

    python bench/bench_cp.py            # full run (about 5 minutes on 2 cores)
    python bench/bench_cp.py --quick    # smoke run: 512/1024-token prompts, 1 round
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_offline import CACHE, SHAPE, build_checkpoint
from moe_runtime.processes.distributed import build_parallel_context, free_port, init_distributed
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LONGEST = 8192
DECODE_BATCH = 8
DECODE_STEPS = 8

logger = logging.getLogger("bench_cp")


def long_checkpoint() -> Path:
    """bench_offline's fp32 checkpoint with max_position_embeddings raised (its rope does not depend on it)."""
    source = build_checkpoint("float32")
    path = CACHE / "qwen3moe-bench-float32-long"
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            if item.name != "config.json":
                shutil.copy2(item, path / item.name)
        config = json.loads((source / "config.json").read_text())
        config["max_position_embeddings"] = LONGEST + 64
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(5, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_config(path: str, cp: int) -> EngineConfig:
    return EngineConfig(model=path, device="cpu", dtype="float32", cp=cp, enable_prefix_caching=False,
                        max_num_seqs=DECODE_BATCH, max_num_batched_tokens=LONGEST, kv_cache_memory=1 << 30)


def sync(parallel: ParallelContext) -> None:
    if parallel.world_size > 1:
        dist.barrier(group=parallel.world_control_group)


def run_scenarios(core: EngineCore, lengths: list[int], rounds: int, decode_context: int) -> dict:
    """Prefill step time per prompt length (best of `rounds`), then decode step time of a batch of
    DECODE_BATCH sequences at `decode_context` tokens of context; with the tokens every request generated."""
    parallel, result, tokens = core.parallel, {"prefill_s": {}, "tokens": {}}, {}
    cp = core.model.context_parallel
    for length in lengths:
        best = float("inf")
        for round_index in range(rounds):
            request_id = f"prefill-{length}-{round_index}"
            core.add_request(request_id, prompt(length, length), SamplingParams(max_tokens=1, temperature=0.0,
                                                                                ignore_eos=True))
            bytes_before = cp.stats.bytes_received if cp else 0
            seconds_before = cp.stats.seconds if cp else 0.0
            sync(parallel)
            started = time.perf_counter()
            deltas = core.step()
            best = min(best, time.perf_counter() - started)
            tokens[request_id] = [t for d in deltas for t in d.new_token_ids]
            if core.has_unfinished():
                raise RuntimeError("the prompt did not prefill in one step")
            if cp:
                result.setdefault("exchange", {})[str(length)] = {
                    "bytes_received_per_layer": (cp.stats.bytes_received - bytes_before) / core.model.num_layers,
                    "exchange_s": cp.stats.seconds - seconds_before}
        result["prefill_s"][str(length)] = best
    for index in range(DECODE_BATCH):
        core.add_request(f"decode-{index}", prompt(decode_context, 7 + index),
                         SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, ignore_eos=True))
    generated: dict[str, list[int]] = {}
    while any(s.num_cached_tokens == 0 for s in core._sequences.values()):   # prefill them (not timed)
        for delta in core.step():
            generated.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    seconds_before = cp.stats.seconds if cp else 0.0
    sync(parallel)
    started = time.perf_counter()
    for _ in range(DECODE_STEPS):
        for delta in core.step():
            generated.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    result["decode_step_s"] = (time.perf_counter() - started) / DECODE_STEPS
    result["decode_exchange_s_per_step"] = ((cp.stats.seconds - seconds_before) / DECODE_STEPS) if cp else 0.0
    while core.has_unfinished():
        for delta in core.step():
            generated.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    tokens.update(generated)
    result["tokens"] = tokens
    if parallel.world_size > 1:
        result["sharded_decode_collective_s_per_step"] = sharded_decode_collective(parallel, core.model.num_layers)
    return result


def sharded_decode_collective(parallel: ParallelContext, layers: int, repeats: int = 50) -> float:
    """Per decode step: the all-gather each layer would need if the cache were sharded by sequence (every rank
    attends all DECODE_BATCH queries over its shard, then the ranks merge partial outputs by log-sum-exp)."""
    heads, head_dim = SHAPE["num_attention_heads"], SHAPE["head_dim"]
    partial = torch.zeros(DECODE_BATCH, heads, head_dim + 1)          # [B, heads, dv + lse]
    parts = [torch.empty_like(partial) for _ in range(parallel.cp_size)]
    dist.all_gather(parts, partial, group=parallel.cp_group)        # warm-up
    sync(parallel)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather(parts, partial, group=parallel.cp_group)
    return layers * (time.perf_counter() - started) / repeats


def rank_main(rank: int, world: int, threads: int, port: int, path: str, lengths: list[int], rounds: int,
              decode_context: int, queue) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    try:
        config = engine_config(path, world)
        if world > 1:
            init_distributed(rank, world, torch.device("cpu"), "env://", "127.0.0.1", port, 900.0)
            parallel = build_parallel_context(config.layout(), rank, torch.device("cpu"), SHAPE["num_hidden_layers"])
        else:
            parallel = None
        core = EngineCore(config, parallel)
        run_scenarios(core, [256], 1, 256)   # warm-up
        queue.put((rank, run_scenarios(core, lengths, rounds, decode_context), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))


def run_engine(world: int, threads: int, path: str, lengths: list[int], rounds: int,
               decode_context: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, world, threads, port, path, lengths, rounds, decode_context,
                                                 queue), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    results: list = [None] * world
    for _ in procs:
        rank, result, error = queue.get(timeout=3600)
        if error is not None:
            for proc in procs:
                proc.kill()
            raise SystemExit(f"cp={world} rank {rank} failed:\n{error}")
        results[rank] = result
    for proc in procs:
        proc.join(timeout=60)
    return results


def transformers_prefill(path: str, lengths: list[int], rounds: int, queue) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                 attn_implementation="sdpa").eval()
    out = {}
    with torch.no_grad():
        model(torch.tensor([prompt(256, 256)]), use_cache=False)    # warm-up
        for length in lengths:
            ids = torch.tensor([prompt(length, length)])
            best = float("inf")
            for _ in range(rounds):
                started = time.perf_counter()
                model(ids, use_cache=False)
                best = min(best, time.perf_counter() - started)
            out[str(length)] = best
    queue.put(out)


def in_subprocess(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue), daemon=True)
    proc.start()
    result = queue.get(timeout=3600)
    proc.join(timeout=60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: 512/1024-token prompts, 1 round")
    parser.add_argument("--out", default=str(RESULTS / "cp.json"))
    args = parser.parse_args()
    lengths, decode_context = ([512, 1024], 512) if args.quick else ([2048, LONGEST], 2048)
    rounds = 1 if args.quick else args.rounds
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = str(long_checkpoint())
    load_before, started = os.getloadavg(), time.perf_counter()
    logger.info("cp=1 (one process, 2 threads)")
    [one] = run_engine(1, 2, path, lengths, rounds, decode_context)
    logger.info("cp=1 (one process, 1 thread)")
    [alone] = run_engine(1, 1, path, lengths, rounds, decode_context)
    logger.info("cp=2 (two ranks, 1 thread each)")
    two = run_engine(2, 1, path, lengths, rounds, decode_context)
    logger.info("transformers forward")
    hf = in_subprocess(transformers_prefill, path, lengths, rounds)
    kv_row_bytes = SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 2 * 4    # K and V, fp32, per token per layer
    rows = []
    for length in lengths:
        key = str(length)
        cp2 = max(r["prefill_s"][key] for r in two)
        received = [r["exchange"][key]["bytes_received_per_layer"] for r in two]
        rows.append({
            "prompt_tokens": length, "cp1_prefill_s": one["prefill_s"][key], "cp2_prefill_s": cp2,
            "speedup_cp2_vs_cp1": one["prefill_s"][key] / cp2, "transformers_prefill_s": hf[key],
            "cp1_one_thread_prefill_s": alone["prefill_s"][key],
            "scaling_cp2_vs_cp1_one_thread": alone["prefill_s"][key] / cp2,
            "speedup_cp2_vs_transformers": hf[key] / cp2,
            "kv_bytes_received_per_layer_per_rank": received,
            "kv_bytes_expected_per_layer_per_rank": [length // 2 * kv_row_bytes] * 2,
            "exchange_share_of_prefill": [r["exchange"][key]["exchange_s"] / cp2 for r in two],
        })
    decode = {
        "batch": DECODE_BATCH, "context_tokens": decode_context,
        "cp1_step_ms": 1e3 * one["decode_step_s"], "cp2_step_ms": 1e3 * max(r["decode_step_s"] for r in two),
        "cp1_one_thread_step_ms": 1e3 * alone["decode_step_s"],
        "cp2_exchange_ms_per_step": [1e3 * r["decode_exchange_s_per_step"] for r in two],
        "sharded_kv_would_add_ms_per_step": [1e3 * r["sharded_decode_collective_s_per_step"] for r in two],
    }
    decode["speedup_cp2_vs_cp1"] = decode["cp1_step_ms"] / decode["cp2_step_ms"]
    tokens_equal = one["tokens"] == alone["tokens"] == two[0]["tokens"] == two[1]["tokens"]
    result = {
        "command": "python bench/bench_cp.py" + (" --quick" if args.quick else ""),
        "setup": {"checkpoint": "bench_offline Qwen3-MoE, max_position_embeddings raised", "shape": SHAPE,
                  "dtype": "float32", "rounds": rounds, "cp1": "1 process x 2 threads (and x 1 thread)",
                  "cp2": "2 ranks x 1 thread"},
        "environment": {"cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
                        "torch": torch.__version__, "python": platform.python_version(),
                        "wall_s": round(time.perf_counter() - started, 1)},
        "prefill": rows, "decode": decode, "tokens_equal_cp1_cp2": tokens_equal,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'prompt':>7} {'cp=1 s':>8} {'cp=1 1thr s':>12} {'cp=2 s':>8} {'vs cp=1':>8} {'vs 1thr':>8} "
          f"{'HF s':>8} {'cp2/HF':>7} {'KV MiB/layer/rank':>18} {'exchange share':>15}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['cp1_prefill_s']:>8.2f} {r['cp1_one_thread_prefill_s']:>12.2f} "
              f"{r['cp2_prefill_s']:>8.2f} {r['speedup_cp2_vs_cp1']:>7.2f}x {r['scaling_cp2_vs_cp1_one_thread']:>7.2f}x "
              f"{r['transformers_prefill_s']:>8.2f} "
              f"{r['speedup_cp2_vs_transformers']:>6.2f}x {r['kv_bytes_received_per_layer_per_rank'][0] / 2**20:>18.2f} "
              f"{max(r['exchange_share_of_prefill']):>14.1%}")
    print(f"\ndecode, batch {DECODE_BATCH} at {decode_context} tokens of context: cp=1 {decode['cp1_step_ms']:.1f} ms, "
          f"cp=2 {decode['cp2_step_ms']:.1f} ms ({decode['speedup_cp2_vs_cp1']:.2f}x), K/V exchange "
          f"{max(decode['cp2_exchange_ms_per_step']):.2f} ms/step; a sequence-sharded cache would add "
          f"{max(decode['sharded_kv_would_add_ms_per_step']):.2f} ms/step of merges")
    print(f"greedy tokens equal (cp=1 vs cp=2): {tokens_equal}\nwrote {args.out}")


if __name__ == "__main__":
    main()
