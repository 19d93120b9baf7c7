"""The front's cost per token, over both engine-core clients, side by side in one process:

- `ranks`: worker ranks (`ep=2, dp_attn=2`) on the embedded demo model; the control socket is registered
  with the asyncio loop, which takes in each rank message as it arrives;
- `inprocess`: one rank in this process; its core thread hands each step's messages to the loop.

Front overhead per token = the time a stream's consumer on the loop receives an output minus the
wall-clock time at which the rank sent the step that produced it (`RequestOutput.sampled_at`):
socket transit, decoding, detokenization and every hand-off up to the coroutine that writes the
SSE chunk. Measured for 1 and 64 concurrent streams; the configurations run in alternating order.

Also the bytes that cross the control plane per generated token, for one request of 16 and of
1024 output tokens (flat: ranks send only what is new).

    python bench/bench_front.py                    # about 2-4 minutes on 2 cores
    python bench/bench_front.py --streams 1 8 --tokens 32 --rounds 1   # quick look

Writes bench/results/front.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.demo.demo_model import ensure_demo_model
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.front.front import Front
from moe_runtime.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPT = list(range(40, 72))
logger = logging.getLogger("bench_front")


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def start_engine(model: Path, mode: str = "ranks") -> Front:
    ranks = {"ep": 2, "dp_attn": 2} if mode == "ranks" else {}
    return make_engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=128, **ranks))


async def run_streams(async_engine: AsyncEngine, streams: int, tokens: int) -> dict:
    overheads: list[float] = []
    gaps: list[float] = []

    async def one(index: int) -> int:
        received = 0
        last = None
        async for output in async_engine.generate(f"s{index}-{time.monotonic_ns()}", PROMPT, greedy(tokens)):
            now = time.time()
            if output.new_token_ids and output.sampled_at:
                overheads.append(now - output.sampled_at)
                if last is not None:
                    gaps.append(now - last)
                last = now
            received += len(output.new_token_ids)
        return received

    started = time.perf_counter()
    produced = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    elapsed = time.perf_counter() - started
    ms = lambda values, q: round(float(np.percentile(values, q)) * 1e3, 3) if values else None  # noqa: E731
    return {"overhead_p50_ms": ms(overheads, 50), "overhead_p99_ms": ms(overheads, 99),
            "itl_p50_ms": ms(gaps, 50), "itl_p99_ms": ms(gaps, 99),
            "tokens_per_s": round(produced / elapsed, 1), "outputs_measured": len(overheads)}


def measure_front(model: Path, mode: str, streams: int, tokens: int) -> dict:
    engine = start_engine(model, mode)
    async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
    try:
        async def scenario():
            await run_streams(async_engine, streams, 4)  # warm-up: compile paths, first allocations
            return await run_streams(async_engine, streams, tokens)

        result = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    logger.info("%s front, %d streams: %s", mode, streams, result)
    return {"front": mode, "streams": streams, **result}


def control_bytes_per_token(model: Path, lengths: list[int]) -> list[dict]:
    engine = start_engine(model)
    rows = []
    try:
        for tokens in lengths:
            before = engine.client.control.traffic.bytes_received
            engine.add_request(f"bytes-{tokens}", PROMPT, greedy(tokens))
            while engine.has_unfinished():
                engine.step()
            received = engine.client.control.traffic.bytes_received - before
            rows.append({"output_tokens": tokens, "bytes_received": received,
                         "bytes_per_token": round(received / tokens, 1)})
    finally:
        engine.shutdown()
    return rows


LEGACY_BYTES_SCRIPT = """
import json, sys
from multiprocessing.connection import Connection
counted = {"bytes": 0}
original = Connection._recv_bytes
def counting(self, maxsize=None):
    buffer = original(self, maxsize)
    counted["bytes"] += len(buffer.getvalue())
    return buffer
Connection._recv_bytes = counting
from moe_runtime import LLM, SamplingParams
rows = []
with LLM(sys.argv[1], device="cpu", dtype="float32", ep=2, dp_attn=2) as llm:
    for tokens in map(int, sys.argv[3:]):
        before = counted["bytes"]
        llm.generate([json.loads(sys.argv[2])], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        received = counted["bytes"] - before
        rows.append({"output_tokens": tokens, "bytes_received": received, "bytes_per_token": round(received / tokens, 1)})
print("ROWS" + json.dumps(rows))
"""


def legacy_bytes_per_token(tree: Path, model: Path, lengths: list[int]) -> list[dict]:
    """The same count on a checkout of the pickle control plane (cumulative outputs every step):
    bytes read from its `multiprocessing.connection` pipes, counted by wrapping their reader."""
    done = subprocess.run([sys.executable, "-c", LEGACY_BYTES_SCRIPT, str(model), json.dumps(PROMPT),
                           *map(str, lengths)], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, timeout=1800)
    marker = [line for line in done.stdout.splitlines() if line.startswith("ROWS")]
    if not marker:
        raise RuntimeError(f"legacy byte count failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(marker[0][4:])


def summarize(rows: list[dict]) -> dict:
    """Median over rounds of each (front, streams) cell, and ranks/in-process ratios."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["front"], row["streams"]), []).append(row)
    summary = {}
    for (front, streams), group in sorted(cells.items()):
        summary[f"{front}/{streams}"] = {key: float(np.median([g[key] for g in group]))
                                         for key in group[0] if key not in ("front", "streams")
                                         and group[0][key] is not None}
    for streams in sorted({s for _, s in cells}):
        local, ranks = summary.get(f"inprocess/{streams}"), summary.get(f"ranks/{streams}")
        if local and ranks:
            summary[f"ranks_over_inprocess/{streams}"] = {
                "overhead_p50": round(ranks["overhead_p50_ms"] / local["overhead_p50_ms"], 3),
                "overhead_p99": round(ranks["overhead_p99_ms"] / local["overhead_p99_ms"], 3)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--rounds", type=int, default=2, help="each configuration runs this often, alternating")
    parser.add_argument("--bytes-lengths", type=int, nargs="+", default=[16, 1024])
    parser.add_argument("--legacy-tree", type=Path, default=None,
                        help="a checkout of the pickle control plane (e.g. `git worktree add /tmp/legacy 35eb1a4`): "
                             "its control-plane bytes per token too")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "front.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("moe_runtime").setLevel(logging.WARNING)
    model = ensure_demo_model()
    rows = []
    for round_index in range(args.rounds):
        modes = ["inprocess", "ranks"] if round_index % 2 == 0 else ["ranks", "inprocess"]
        for streams in args.streams:
            for mode in modes:
                rows.append({"round": round_index, **measure_front(model, mode, streams, args.tokens)})
    bytes_rows = control_bytes_per_token(model, args.bytes_lengths)
    legacy_rows = legacy_bytes_per_token(args.legacy_tree, model, args.bytes_lengths) if args.legacy_tree else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    result = {
        "what": "front overhead per token (core sent -> output on the streaming coroutine), ranks (ep=2 dp_attn=2) "
                "and one in-process rank on the demo model; control-plane bytes per token",
        "machine": {"cpus": platform.processor() or platform.machine(), "python": platform.python_version()},
        "commit": commit.stdout.strip(), "tokens_per_stream": args.tokens, "rows": rows,
        "summary": summarize(rows), "control_plane_bytes": bytes_rows,
        "legacy_control_plane_bytes": legacy_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"summary": result["summary"], "control_plane_bytes": bytes_rows, "legacy": legacy_rows},
                     indent=2))


if __name__ == "__main__":
    main()
