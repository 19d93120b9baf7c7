"""The front's cost of admitting one long prompt: time the event loop is blocked, and control-plane bytes.

A 128k-token prompt is admitted through the real `AsyncEngine` and `Front` (limits check, block hashes for
cache-aware routing, routing, the `AddRequest`), over a core client that encodes every message it would
send with the control plane's codec and counts the bytes per rank, for a wide layout (64 ranks, one per DP
worker, as DP attention + EP 64 has it). Two ways, side by side in one run:

- `inline, broadcast`: the admission checks on the event loop, and the prompt to every rank (the front
  before this measurement: every rank decoded the prompt and dropped it unless it was its worker's);
- `offloaded, to its worker`: prompts longer than `offload_prompt_tokens` are checked in a worker thread,
  and only the chosen worker's ranks get the prompt; the others a fixed-size `AdmittedElsewhere`.

Blocked time = the longest gap a 1 ms ticker on the loop sees while the request is admitted.

    python bench/bench_admission.py                  # a few seconds

Writes bench/results/admission.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

from moe_runtime.attention_dp.messages import AddRequest, AdmittedElsewhere, MessageCodec
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.stats import EngineHealth
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.front.core_client import CoreShape
from moe_runtime.front.front import Front
from moe_runtime.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent


class CountingClient:
    """An engine-core client that runs no core: it encodes what it is sent and counts bytes per rank."""

    def __init__(self, world: int, max_model_len: int, broadcast_prompts: bool):
        self.tokenizer = None
        self.shape = CoreShape(block_size=16, num_kv_blocks=max_model_len // 16 + 1, max_model_len=max_model_len,
                               vocab_size=150_000, pp_size=1, worker_ranks={dp: [dp] for dp in range(world)},
                               kv_shards={rank: None for rank in range(world)})
        self.codec = MessageCodec()
        self.broadcast_prompts = broadcast_prompts
        self.bytes_sent = 0

    def send(self, command, only_worker: int | None = None) -> None:
        ranks = self.shape.world_size
        if only_worker is None or self.broadcast_prompts:
            self.bytes_sent += len(self.codec.encode(command)) * ranks
            return
        own = len(self.shape.worker_ranks[only_worker])
        self.bytes_sent += len(self.codec.encode(command)) * own
        self.bytes_sent += len(self.codec.encode(AdmittedElsewhere())) * (ranks - own)

    def receive(self, timeout: float):
        return []

    def attach(self, on_messages, on_lost) -> None:
        pass

    def detach(self) -> None:
        pass

    def health(self) -> EngineHealth:
        return EngineHealth(True)

    def shutdown(self) -> None:
        pass


async def admit_once(async_engine: AsyncEngine, request_id: str, prompt: list[int]) -> float:
    """The longest loop stall (ms) seen by a 1 ms ticker while `prompt` is admitted."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    await async_engine.submit(request_id, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    await asyncio.sleep(0.005)
    done.set()
    await task
    return max(gaps) * 1e3


def measure(way: str, prompt_tokens: int, world: int, repeats: int) -> dict:
    offloaded = way == "offloaded, to its worker"
    client = CountingClient(world, prompt_tokens + 64, broadcast_prompts=not offloaded)
    config = EngineConfig(model="unused", enable_prefix_caching=True, cache_aware_routing=True)
    front = Front(config, client)
    offload = 4096 if offloaded else 1 << 62
    async_engine = AsyncEngine(front, AsyncEngineConfig(offload_prompt_tokens=offload)).start()
    prompt = [(7 * i + 3) % 150_000 for i in range(prompt_tokens)]

    async def run() -> list[float]:
        stalls = []
        for index in range(repeats):
            before = client.bytes_sent
            stalls.append(await admit_once(async_engine, f"{way}-{index}", prompt))
            sent = client.bytes_sent - before
            async_engine.front.abort(f"{way}-{index}")
        return stalls, sent

    stalls, sent = asyncio.run(run())
    check_started = time.perf_counter()
    front.prepare("timing", prompt, SamplingParams(max_tokens=16))
    prepare_ms = (time.perf_counter() - check_started) * 1e3
    return {"way": way, "loop_blocked_ms_median": round(statistics.median(stalls), 2),
            "loop_blocked_ms_max": round(max(stalls), 2), "checks_and_hashes_ms": round(prepare_ms, 2),
            "control_plane_bytes": sent, "control_plane_mib": round(sent / 2**20, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=131_072)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "admission.json")
    args = parser.parse_args()
    rows = [measure(way, args.prompt_tokens, args.ranks, args.repeats)
            for way in ("inline, broadcast", "offloaded, to its worker")]
    before, after = rows
    result = {
        "what": f"admitting one {args.prompt_tokens}-token prompt at {args.ranks} ranks (one per DP worker): "
                "longest event-loop stall, and control-plane bytes of the request",
        "machine": {"cpus": platform.processor() or platform.machine(), "python": platform.python_version()},
        "rows": rows,
        "ratios": {"loop_blocked": round(after["loop_blocked_ms_median"] / before["loop_blocked_ms_median"], 3),
                   "bytes": round(after["control_plane_bytes"] / before["control_plane_bytes"], 4)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
