"""Rounds of bench_offline.py merged into one row per (model, dtype, batch): every number the median of its rounds.

A shared machine's speed moves between minutes: `--rounds N` measures every system of every row N times, one
round after the other (round 1 of every row, then round 2, ...), so that a slow stretch hits each system of a
round alike; the row keeps the median of each figure and, under `rounds`, each round's tokens/s and load average.
"""
from __future__ import annotations

import statistics

KEY = ("model", "dtype", "batch")
KEPT_PER_ROUND = ("runtime_tok_s", "compiled_tok_s", "llama_cpp_tok_s", "transformers_tok_s", "vs_llama_cpp",
                  "compiled_vs_llama_cpp", "load_avg_1m", "copy_bandwidth_gbs")


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One row per key, in the first round's order: numeric fields as medians, others as the first round has
    them; `rounds` lists the per-round values of KEPT_PER_ROUND."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for first in rounds[0]:
        same = [row for rows in rounds for row in rows if all(row.get(k) == first.get(k) for k in KEY)]
        row = dict(first)
        for name, value in first.items():
            values = [r[name] for r in same if isinstance(r.get(name), (int, float)) and not isinstance(r[name], bool)]
            if isinstance(value, float) and len(values) == len(same):
                row[name] = statistics.median(values)
        row["rounds"] = {name: [r.get(name) for r in same] for name in KEPT_PER_ROUND if name in first}
        merged.append(row)
    return merged
