"""Dense model under tensor and pipeline parallelism vs one rank, on this machine.

Builds (once, under bench/.cache) a ~90M-parameter Llama checkpoint (hidden 768, 12 layers,
intermediate 2048, 12 heads / 4 KV heads, vocab 8192, fp32) and runs, per layout, a prefill-heavy
batch (8 prompts x 256 tokens, 1 new token) and a decode-heavy one (8 prompts x 16 tokens,
64 new tokens): prefill tokens/s, decode tokens/s and per-step latency; per-rank weight bytes; and
for pp=2 the measured pipeline bubble (1 - compute / step time on the last stage) with 1, 2 and 4
micro-batches, beside the ideal GPipe bubble (M - 1) / (n + M - 1). Writes bench/results/tp_pp.json.

    python bench/bench_tp_pp.py [--layouts one tp2 pp2 tp2pp2] [--micro-batches 1 2 4]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from moe_runtime.planner.calibration.calibration_models import LLAMA_DENSE_SHAPE

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results"
SHAPE = LLAMA_DENSE_SHAPE   # the planner's CPU calibration times this shape too
LAYOUTS = {"one": {}, "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2pp2": dict(tp=2, pp=2)}
logger = logging.getLogger("bench_tp_pp")


def build_checkpoint() -> Path:
    path = CACHE / "llama-90m"
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM, LlamaConfig

    from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights

    logger.info("building the ~90M dense checkpoint in %s", path)
    config = LlamaConfig(**SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed=0, scales=RandomWeightScales(matrix_std=0.03))
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def prompts(count: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(10, SHAPE["vocab_size"], (count, length), generator=generator).tolist()


def last_stage_stats(llm):
    return llm.engine.stats().workers[0] if hasattr(llm.engine, "ready") else llm.engine.worker_stats()


def measure(path: Path, layout: dict, micro_batches: int) -> dict:
    from moe_runtime import LLM, SamplingParams

    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    with LLM(str(path), device="cpu", dtype="float32", pp_micro_batches=micro_batches, **layout) as llm:
        llm.generate(prompts(2, 8), greedy(2))  # warm-up
        started = time.perf_counter()
        llm.generate(prompts(8, 256), greedy(1))
        prefill_s = time.perf_counter() - started
        before = last_stage_stats(llm)
        started = time.perf_counter()
        llm.generate(prompts(8, 16), greedy(64))
        decode_s = time.perf_counter() - started
        after = last_stage_stats(llm)
        steps = after.steps - before.steps
        step_s = after.step_seconds - before.step_seconds
        compute_s = after.compute_seconds - before.compute_seconds
        ready = getattr(llm.engine, "ready", None)
        weights = ([r.weight_bytes for _, r in sorted(ready.items())] if ready else
                   [sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())])
    return dict(layout=layout or {"ranks": 1}, micro_batches=micro_batches,
                prefill_tok_s=8 * 256 / prefill_s, decode_tok_s=8 * 64 / decode_s,
                decode_step_ms=1000 * step_s / max(steps, 1),
                bubble_measured=1 - compute_s / step_s if step_s else 0.0,
                weight_bytes_per_rank=weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["one", "tp2", "pp2", "tp2pp2"], choices=list(LAYOUTS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = build_checkpoint()
    rows = []
    for name in args.layouts:
        layout = LAYOUTS[name]
        pp = layout.get("pp", 1)
        for micro in (args.micro_batches if pp > 1 else [1]):
            logger.info("layout %s, %d micro-batch(es)", name, micro)
            row = measure(path, layout, micro)
            row["name"] = name
            row["bubble_ideal"] = (pp - 1) / (micro + pp - 1) if pp > 1 else 0.0
            rows.append(row)
    base = rows[0]
    print(f"\nDense ~90M Llama, fp32, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    header = (f"{'layout':8} {'mb':>3} {'prefill tok/s':>14} {'vs one':>7} {'decode tok/s':>13} {'vs one':>7} "
              f"{'ms/step':>8} {'bubble':>7} {'ideal':>6} {'MiB/rank':>18}")
    print(header)
    print("-" * len(header))
    for r in rows:
        mib = ",".join(f"{b / 2**20:.0f}" for b in r["weight_bytes_per_rank"])
        print(f"{r['name']:8} {r['micro_batches']:>3} {r['prefill_tok_s']:>14.1f} "
              f"{r['prefill_tok_s'] / base['prefill_tok_s']:>6.2f}x {r['decode_tok_s']:>13.1f} "
              f"{r['decode_tok_s'] / base['decode_tok_s']:>6.2f}x {r['decode_step_ms']:>8.1f} "
              f"{r['bubble_measured']:>7.2f} {r['bubble_ideal']:>6.2f} {mib:>18}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "tp_pp.json"
    out.write_text(json.dumps(dict(benchmark="tp_pp", shape=SHAPE, cores=os.cpu_count(),
                                   load_average=os.getloadavg()[0], rows=rows,
                                   command="python bench/bench_tp_pp.py"), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
