"""Prefill/decode disaggregation benchmark.

1. Decoders streaming while long prompts arrive. A closed loop of --decoders streaming clients
   (each generates --decode-tokens tokens, then starts again) runs for --seconds while a long prompt
   (--long-prompt tokens, 2 output tokens) arrives every --long-every seconds. Two set-ups with the
   same total ranks (2 by default): one colocated instance (`--ep 2 --dp-attn 2`, chunked prefill
   with --chunk tokens per step) and a P/D set (`moe-serve --pd 1:1`: one 1-rank prefill instance, one
   1-rank decode instance, the router). Reports the decoders' inter-token latency (gaps between
   streamed chunks) p50/p99 and their throughput, and the long prompts' time to first token.
   Every server process runs one thread per rank (OMP_NUM_THREADS=1).
2. KV transfer speed: a prefill rank's block server in another process holds a parked request of
   --transfer-tokens tokens in a Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128, bf16); a
   decode rank's puller (the engine's own classes) pulls it into its cache, through ZeroMQ over
   loopback TCP with CURVE. GB/s against this machine's memory copy (torch `copy_` of the same bytes),
   best of --repeats each. A second run re-shards: two prefill ranks (attention TP 2) into one.

    python bench/bench_pd.py                      # about 3 minutes on 2 shared CPU cores
    python bench/bench_pd.py --seconds 10 --skip-serving    # the transfer part only

Writes bench/results/pd.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import msgspec
import numpy as np
import torch
import zmq

from moe_runtime.disaggregation.kv_transfer.block_server import KVBlockServer
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.plan import plan_pulls
from moe_runtime.disaggregation.kv_transfer.puller import KVPuller, PullJob
from moe_runtime.disaggregation.kv_transfer.registry import ExportRegistry
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache

REPO_ROOT = Path(__file__).resolve().parents[1]

LISTENING = re.compile(r"moe-serve: serving .* on (http://[^\s]+)")
KV_SECRET = "bench-pd-secret-0123456789abcdef"


# ---- 1. serving -------------------------------------------------------------------------------
@dataclass
class Server:
    args: list[str]
    threads: int = 1
    url: str = ""
    process: subprocess.Popen | None = None
    log: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 600.0) -> "Server":
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads), MOE_RUNTIME_KV_KEY=KV_SECRET)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "moe_runtime.server.cli", *self.args, "--host", "127.0.0.1", "--port", "0",
                   "--log-level", "warning"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, cwd=REPO_ROOT)
        ready = threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                self.log.append(line.rstrip())
                match = LISTENING.search(line)
                if match and line.startswith("moe-serve: serving"):
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or not self.url:
            self.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(self.log[-40:]))
        deadline = time.monotonic() + timeout_s
        while httpx.get(self.url + "/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("server never healthy")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Workload:
    decoders: int
    decode_tokens: int
    long_prompt: int
    long_every_s: float
    seconds: float
    vocab_size: int


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Times (perf_counter) at which each streamed chunk with text arrived; [] on an error."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return []
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return []
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    return times


async def run_workload(url: str, work: Workload, seed: int = 0) -> dict:
    rng = random.Random(seed)
    stop_at = time.perf_counter() + work.seconds
    gaps: list[float] = []
    decoded = 0
    ttfts: list[float] = []
    failures = 0

    async def decoder(index: int) -> None:
        nonlocal decoded, failures
        async with httpx.AsyncClient(timeout=600) as client:
            while time.perf_counter() < stop_at:
                prompt = [rng.randrange(5, work.vocab_size) for _ in range(32)]
                times = await stream_completion(client, url, prompt, work.decode_tokens)
                if not times:
                    failures += 1
                    continue
                decoded += len(times)
                gaps.extend(b - a for a, b in zip(times, times[1:]))

    async def long_prompts() -> None:
        nonlocal failures
        async with httpx.AsyncClient(timeout=600) as client:
            pending = []
            while time.perf_counter() < stop_at:
                prompt = [rng.randrange(5, work.vocab_size) for _ in range(work.long_prompt)]

                async def one(prompt=prompt) -> None:
                    nonlocal failures
                    started = time.perf_counter()
                    times = await stream_completion(client, url, prompt, 2)
                    if times:
                        ttfts.append(times[0] - started)
                    else:
                        failures += 1

                pending.append(asyncio.create_task(one()))
                await asyncio.sleep(work.long_every_s)
            await asyncio.gather(*pending)

    started = time.perf_counter()
    prompts = asyncio.create_task(long_prompts())
    await asyncio.gather(*(decoder(i) for i in range(work.decoders)))
    wall = time.perf_counter() - started          # the decoders' time: throughput is theirs
    await prompts                                 # long prompts still queued finish (their TTFT counts)
    return {
        "decoder_itl_p50_ms": 1000 * float(np.percentile(gaps, 50)) if gaps else None,
        "decoder_itl_p99_ms": 1000 * float(np.percentile(gaps, 99)) if gaps else None,
        "decoder_itl_max_ms": 1000 * max(gaps) if gaps else None,
        "decoder_tokens_per_s": decoded / wall,
        "long_prompts": len(ttfts),
        "long_prompt_ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
        "long_prompt_ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
        "failures": failures,
        "decoders_wall_s": wall,
        "load_average": os.getloadavg()[0],
    }


def serving_bench(args) -> dict:
    model = ["--model", args.model] if args.model else []
    common = [*model, "--device", "cpu", "--kv-cache-memory", "64M", "--max-num-batched-tokens", str(args.chunk)]
    setups = {
        "colocated": ["--ep", "2", "--dp-attn", "2", *common],
        "pd": ["--pd", "1:1", *common],
    }
    # token-id prompts drawn below 4000: inside the demo model's vocabulary (4096) and any real one's
    work = Workload(args.decoders, args.decode_tokens, args.long_prompt, args.long_every, args.seconds, 4000)
    results = {}
    for name, server_args in setups.items():
        server = Server(server_args).start()
        try:
            asyncio.run(run_workload(server.url, Workload(2, 8, 64, 1.0, 4.0, work.vocab_size)))   # warm-up
            results[name] = asyncio.run(run_workload(server.url, work))
            print(f"{name}: {results[name]}", flush=True)
        finally:
            server.stop()
    colocated, pd = results["colocated"], results["pd"]
    return {
        "setups": setups,
        "workload": asdict(work),
        "results": results,
        "itl_p99_pd_over_colocated": (pd["decoder_itl_p99_ms"] / colocated["decoder_itl_p99_ms"]
                                      if pd["decoder_itl_p99_ms"] and colocated["decoder_itl_p99_ms"] else None),
        "throughput_pd_over_colocated": pd["decoder_tokens_per_s"] / max(colocated["decoder_tokens_per_s"], 1e-9),
    }


# ---- 2. KV transfer speed ---------------------------------------------------------------------
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def cache_shape(num_blocks: int, heads: int) -> tuple[int, ...]:
    return (num_blocks, BLOCK, heads, HEAD_DIM)


def serve_blocks(num_blocks: int, head_start: int, heads: int, ready, stop) -> None:
    """A prefill rank in its own process: a parked request over every block of a filled cache."""
    torch.set_num_threads(1)
    spec = KVCacheSpec(heads, HEAD_DIM, HEAD_DIM, head_start, KV_HEADS)
    caches = [LayerKVCache.allocate(spec, num_blocks, BLOCK, torch.bfloat16, "cpu") for _ in range(LAYERS)]
    for layer, cache in enumerate(caches):
        cache.keys.fill_(layer)
        cache.values.fill_(-layer)
    registry = ExportRegistry()
    registry.park("bench", list(range(num_blocks)), num_blocks * BLOCK)
    server = KVBlockServer(caches, KVShard.of([spec] * LAYERS, 0, BLOCK, torch.bfloat16), registry,
                           TransferKey.from_secret(KV_SECRET.encode()), "127.0.0.1")
    ready.put(msgspec.msgpack.encode(server.shard))
    stop.wait()
    server.close()


def transfer_bench(args) -> dict:
    torch.set_num_threads(1)
    num_blocks = args.transfer_tokens // BLOCK
    spec = KVCacheSpec(KV_HEADS, HEAD_DIM, HEAD_DIM, 0, KV_HEADS)
    caches = [LayerKVCache.allocate(spec, num_blocks, BLOCK, torch.bfloat16, "cpu") for _ in range(LAYERS)]
    local = KVShard.of([spec] * LAYERS, 0, BLOCK, torch.bfloat16)
    total_bytes = sum(c.keys.numel() * c.keys.element_size() * 2 for c in caches)
    key = TransferKey.from_secret(KV_SECRET.encode())
    context = mp.get_context("spawn")
    out = {"tokens": args.transfer_tokens, "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "dtype": "bfloat16", "bytes": total_bytes}
    for name, splits in (("tp1_to_tp1", [(0, KV_HEADS)]), ("tp2_to_tp1", [(0, KV_HEADS // 2),
                                                                           (KV_HEADS // 2, KV_HEADS // 2)])):
        ready, stop = context.Queue(), context.Event()
        servers = [context.Process(target=serve_blocks, args=(num_blocks, start, heads, ready, stop), daemon=True)
                   for start, heads in splits]
        for server in servers:
            server.start()
        shards = sorted((msgspec.msgpack.decode(ready.get(timeout=120), type=KVShard) for _ in servers),
                        key=lambda s: s.head_start)
        landed = threading.Event()
        puller = KVPuller(caches, local, key, on_landed=landed.set)
        seconds = []
        try:
            for attempt in range(args.repeats):
                landed.clear()
                puller.submit(PullJob(f"job{attempt}", "bench", list(range(num_blocks)), num_blocks * BLOCK,
                                      plan_pulls(local, shards), timeout_s=300))
                landed.wait(300)
                [result] = puller.take_landed()
                assert result.error is None and result.num_bytes == total_bytes, result
                seconds.append(result.seconds)
            assert float(caches[5].keys[3, 0, 0, 0]) == 5.0 and float(caches[5].values[3, 0, 0, 0]) == -5.0
        finally:
            puller.close()
            stop.set()
            for server in servers:
                server.join(10)
        out[name] = {"best_s": min(seconds), "gb_per_s": total_bytes / min(seconds) / 1e9,
                     "runs_s": seconds}
        print(f"transfer {name}: {out[name]['gb_per_s']:.2f} GB/s", flush=True)
    source = torch.randn(total_bytes // 2, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    copies = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        target.copy_(source)
        copies.append(time.perf_counter() - started)
    out["memory_copy"] = {"best_s": min(copies), "gb_per_s": total_bytes / min(copies) / 1e9}
    out["transfer_over_memory_copy"] = out["tp1_to_tp1"]["gb_per_s"] / out["memory_copy"]["gb_per_s"]
    out["curve_loopback_gb_per_s"] = curve_ceiling(args.repeats)
    print(f"memory copy: {out['memory_copy']['gb_per_s']:.2f} GB/s, ZeroMQ CURVE over loopback: "
          f"{out['curve_loopback_gb_per_s']:.2f} GB/s", flush=True)
    return out


def curve_ceiling(repeats: int, piece_bytes: int = 4 * 2**20, pieces: int = 32) -> float:
    """What ZeroMQ with CURVE (encrypted, authenticated) moves over loopback between two sockets of this
    process, in the puller's piece size with the same window: the transport's own ceiling here."""
    context = zmq.Context()
    public, secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    server = context.socket(zmq.ROUTER)
    server.curve_server, server.curve_publickey, server.curve_secretkey = True, public, secret
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = context.socket(zmq.DEALER)
    client.curve_serverkey, client.curve_publickey, client.curve_secretkey = public, client_public, client_secret
    client.connect(f"tcp://127.0.0.1:{port}")
    payload = bytearray(piece_bytes)

    def serve() -> None:
        for _ in range(pieces * repeats):
            identity, _ = server.recv_multipart()
            server.send_multipart([identity, payload], copy=False)

    thread = threading.Thread(target=serve)
    thread.start()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(4):
            client.send(b"pull")
        for index in range(pieces):
            client.recv(copy=False)
            if index + 4 < pieces:
                client.send(b"pull")
        best = min(best, time.perf_counter() - started)
    thread.join()
    client.close(linger=0)
    server.close(linger=0)
    context.term()
    return piece_bytes * pieces / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded demo model)")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=1536)
    parser.add_argument("--long-every", type=float, default=2.5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--chunk", type=int, default=128, help="--max-num-batched-tokens (chunked prefill)")
    parser.add_argument("--transfer-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "pd.json"))
    args = parser.parse_args()
    started = time.time()
    result = {"benchmark": "prefill/decode disaggregation", "host": platform.node(), "cpus": os.cpu_count(),
              "load_average_at_start": os.getloadavg()[0],
              "python": platform.python_version(), "command": " ".join(["python", "bench/bench_pd.py", *sys.argv[1:]])}
    result["transfer"] = transfer_bench(args)
    if not args.skip_serving:
        result["serving"] = serving_bench(args)
    result["wall_s"] = time.time() - started
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
