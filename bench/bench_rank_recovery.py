"""What a lost worker rank costs: one rank of a 4-rank job SIGKILLed while idle, then the same greedy requests again.

Two recoveries side by side on bench/skewed_checkpoint.py's model (16 experts, 4 MoE layers), four ranks each:
- `ep=4, dp_attn=4`: the three other ranks keep their processes and weights and re-form with a fresh process in
  the lost rank's place (which loads only its share);
- `ep=4, dp_attn=2` (attention TP 2, so a DP worker cannot lose a rank): every rank restarts and reloads.
Recovery seconds are the front's (`RecoveryStats.recovery_seconds`: the loss to every request sent again); the
tokens after the loss must equal those before. Writes bench/results/rank_recovery.json.

    python bench/bench_rank_recovery.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.skewed_checkpoint import build_skewed_checkpoint  # noqa: E402
from moe_runtime import LLM, SamplingParams  # noqa: E402

LAYOUTS = {"re-form with a replacement (ep=4 dp_attn=4)": dict(ep=4, dp_attn=4),
           "restart every rank (ep=4 dp_attn=2, attention TP 2)": dict(ep=4, dp_attn=2)}
PROMPTS = [[(7 * i + 3 * p) % 4000 + 5 for i in range(32)] for p in range(8)]


def recover(path: Path, layout: dict, repeats: int) -> dict:
    llm = LLM(str(path), device="cpu", dtype="float32", max_rank_restarts=repeats + 1, **layout)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        before = [o.token_ids for o in llm.generate(PROMPTS, params)]
        seconds, equal = [], True
        for _ in range(repeats):
            spent = llm.engine.stats().recovery.recovery_seconds
            os.kill(llm.engine.client.processes[1].pid, signal.SIGKILL)
            equal &= [o.token_ids for o in llm.generate(PROMPTS, params)] == before
            seconds.append(llm.engine.stats().recovery.recovery_seconds - spent)
        stats = llm.engine.stats().recovery
        return {"layout": layout, "recovery_seconds": seconds, "median_s": statistics.median(seconds),
                "tokens_equal": equal, "reformations": stats.reformations, "recoveries": stats.recoveries}
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "rank_recovery.json"))
    args = parser.parse_args()
    path = build_skewed_checkpoint()
    rows = {name: recover(path, layout, args.repeats) for name, layout in LAYOUTS.items()}
    for name, row in rows.items():
        print(f"{name}: median {row['median_s']:.2f} s over {args.repeats} losses, tokens equal: {row['tokens_equal']}")
    Path(args.out).write_text(json.dumps({"benchmark": "rank_recovery", "checkpoint": str(path), "rows": rows,
                                          "load_average_1m": os.getloadavg()[0], "cores": os.cpu_count(),
                                          "when": time.strftime("%Y-%m-%d %H:%M")}, indent=2))


if __name__ == "__main__":
    main()
