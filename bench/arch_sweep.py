"""Which architectures run: the sweep of tests/test_arch_sweep.py written to bench/results/arch_sweep.json.

For every model type of the sweep (each causal LM transformers ships with experts, and six dense families; tiny
random checkpoints from tests/arch_sweep_configs.py), our engine on one rank with chunked prefill and a prefix-cache
hit, against transformers' greedy tokens: runs / refused (with the reason) / mismatch / error, and whether our own
port (native) or transformers' modeling code behind our attention and MoE (generic) served it. Where a native port
exists the generic path is tried too (--model-impl transformers). Then --ep 2 --dp-attn 2 for every MoE model type the
generic path runs, on one pooled pair of gloo ranks. Prints a table, the counts, and a Python table of the outcomes in
tests/test_arch_sweep.py's EXPECTED form (to paste when the backend changes).

    python bench/arch_sweep.py                    # everything (~1-2 minutes on 2 cores, oracle cache warm)
    python bench/arch_sweep.py jamba mixtral      # some model types, no JSON written
    python bench/arch_sweep.py --no-ep            # skip the two-rank pass
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))   # the sweep's checkpoints and cases live with the tests

from arch_sweep_cases import (GENERIC, NATIVE, REFUSED, RUNS, RankCase, build_sweep_checkpoint,  # noqa: E402
                              oracle_tokens, run_engine, run_on_rank)
from arch_sweep_configs import DENSE_TYPES, sweep_model_types, unreadable_model_types  # noqa: E402
from multirank import RankPool  # noqa: E402
from tiny_checkpoints import tiny_tokenizer  # noqa: E402

from moe_runtime.demo.tokenizer_training import save_tokenizer  # noqa: E402

RESULT = REPO / "bench" / "results" / "arch_sweep.json"


def short_reason(detail: str) -> str:
    """The backend's own words where a native refusal wraps them ("...; and <backend's reason>")."""
    return detail.split("; and ", 1)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="default: every model type of the sweep")
    parser.add_argument("--no-ep", action="store_true", help="skip --ep 2 --dp-attn 2")
    args = parser.parse_args()
    torch.set_num_threads(1)   # tiny models: a second thread only adds hand-offs
    everything = sweep_model_types()
    chosen = args.model_types or everything
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arch-sweep-") as scratch:
        root = Path(scratch)
        tokenizer_dir = root / "tokenizer"
        tokenizer_dir.mkdir()
        save_tokenizer(tiny_tokenizer(), tokenizer_dir)
        rows: dict[str, dict] = {}
        cases: list[RankCase] = []
        for model_type in chosen:
            t0 = time.perf_counter()
            row: dict = {"dense": model_type in DENSE_TYPES}
            try:
                (root / model_type).mkdir()
                path = build_sweep_checkpoint(model_type, root / model_type, tokenizer_dir)
                expected = oracle_tokens(path)
            except Exception as error:  # noqa: BLE001 - transformers itself cannot build or run it on CPU
                row.update(status="transformers_fails", reason=f"{type(error).__name__}: {error}")
                rows[model_type] = row
                print(f"{model_type:22s} transformers fails: {row['reason'][:150]}", flush=True)
                continue
            outcome = run_engine(model_type, path, expected)
            row.update(status=outcome.status, path=outcome.path, reason=short_reason(outcome.detail),
                       cached_prompt_tokens=outcome.cached_prompt_tokens)
            if outcome.path == NATIVE:
                forced = run_engine(model_type, path, expected, model_impl="transformers")
                row["forced_transformers"] = {"status": forced.status, "reason": short_reason(forced.detail)}
            if outcome.status == RUNS and outcome.path == GENERIC and not row["dense"]:
                cases.append(RankCase(model_type, str(path), expected))
            row["seconds"] = round(time.perf_counter() - t0, 2)
            rows[model_type] = row
            forced = row.get("forced_transformers", {}).get("status", "")
            print(f"{model_type:22s} {outcome.status:8s} {outcome.path:8s} {forced:9s} {row['reason'][:120]}",
                  flush=True)
        if cases and not args.no_ep:
            pool = RankPool(2, call_timeout_s=900)
            try:
                pool.start()
                per_rank = pool.run(run_on_rank, cases, ep=2, dp_attn=2)
            finally:
                pool.close()
            for index, case in enumerate(cases):
                results = [outcomes[index] for outcomes in per_rank]
                runs = all(o.status == RUNS for o in results)
                rows[case.model_type]["ep2_dp_attn2"] = {
                    "status": RUNS if runs else next(o.status for o in results if o.status != RUNS),
                    "reason": "" if runs else next(short_reason(o.detail) for o in results if o.status != RUNS)}
                print(f"{case.model_type:22s} ep2/dp2: {rows[case.model_type]['ep2_dp_attn2']['status']} "
                      f"{rows[case.model_type]['ep2_dp_attn2']['reason'][:120]}", flush=True)
    wall = time.perf_counter() - started
    counts: dict[str, int] = {}
    for row in rows.values():
        key = f"{row['status']}/{row.get('path') or '-'}"
        counts[key] = counts.get(key, 0) + 1
    ep = [r["ep2_dp_attn2"]["status"] for r in rows.values() if "ep2_dp_attn2" in r]
    print(f"\n{len(rows)} model types in {wall:.0f} s: {counts}; ep2/dp2: {ep.count(RUNS)} of {len(ep)} run")
    print("\nEXPECTED rows:")
    for model_type, row in rows.items():
        if row["status"] == RUNS:
            print(f'    "{model_type}": {row["path"]}(),')
        else:
            kind = "refused" if row["status"] == REFUSED else "broken"
            print(f'    "{model_type}": {kind}({row["reason"][:90]!r}),')
    if args.model_types:
        return
    RESULT.write_text(json.dumps({
        "what": "each sweep model type through our engine (one rank, chunked prefill, prefix-cache hit) against "
                "transformers' greedy tokens; native = our port, generic = transformers' modeling code behind our "
                "attention and MoE; forced_transformers: the generic path where a native port exists",
        "transformers": __import__("transformers").__version__, "torch": torch.__version__,
        "machine": platform.machine(), "wall_seconds": round(wall, 1), "counts": counts,
        "ep2_dp_attn2": {"runs": ep.count(RUNS), "tried": len(ep)},
        "default_config_fails": unreadable_model_types(),   # causal LMs transformers cannot even configure
        "model_types": rows}, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
