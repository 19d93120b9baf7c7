"""KV tiers below the device pool: a multi-turn chat whose histories exceed the device KV pool, run with the tiers
off, with a host tier, and with host + disk, side by side in one run, on a plain MoE model and a hybrid one.

The workload: `--conversations` conversations, each a `--first-prompt`-token opening, then `--turns` turns; every
turn is the conversation's history so far (its earlier prompts and the tokens generated for them) plus a new
`--user-tokens`-token user message, generating `--new-tokens` tokens (greedy, eos ignored). Conversations are
served round robin, one request at a time, so by the time a conversation comes back every other one has passed
through the device pool, which `kv_cache_memory` sizes to about `--device-share` of the final histories: its
prefix was evicted from the device, and only a tier can give it back.

The three runs of a model (three engines in one process, each request served on one after the other, so that a
machine shared with other work slows them alike; the same prompts): `off` (device prefix cache only), `host`
(`kv_host_memory` holding every history), `host+disk` (a host tier holding about a quarter of what the tiers get,
and a disk tier in a temporary directory holding it all: most returning prefixes come from the disk). Per run: TTFT p50 /
p99 (submission to the first token's sampling, the engine's own clock), over all requests and over the returning
turns apart (the first turn is cold for every run), prompt tokens, prefill tokens computed (prompt tokens less
those found in the device prefix cache and in the tiers: WorkerStats' prefix_cache_hits and kv_tier_hit_tokens),
the tiers' counters, the seconds each engine spent serving (`serve_s`), and the ratios against `off`. Every run's
greedy tokens must equal `off`'s, or the bench stops (the tiers must never change an answer).

The models (built once, cached under bench/.cache, float32, random weights): bench_offline's Qwen3-MoE shape
(8 layers, 32 experts top-4) with a longer max_position_embeddings, and a hybrid Qwen3.5-MoE shape (transformers'
Qwen3_5MoeTextConfig: three Gated DeltaNet layers then one gated full attention, 8 layers, 64 experts top-8). On
the hybrid model a prefix is reusable only up to a block boundary whose recurrent-state snapshot was captured:
decode steps capture the boundary they cross, and a prefill step only its earliest `max_num_seqs` ones (4 here). A
turn's decode computes its prompt and all but its last generated token, so it crosses a boundary only if those pass
one: prompts of 500 + k * 124 tokens and 24 new tokens cross one every turn, and the next turn resumes from it
(prompts of whole blocks with 16 new tokens would cross none, and reuse only the earliest boundaries).

Histories are scaled down to run on a 2-core CPU in about ten minutes (500 to ~900 tokens by default; real chats
run to tens of thousands). Writes bench/results/kv_tiers.json.

    python bench/bench_kv_tiers.py [--models moe hybrid] [--conversations 8] [--turns 4]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.bench_offline import in_subprocess
from bench.random_checkpoint import save_random_checkpoint
from moe_runtime.planner.calibration.calibration_models import QWEN3_MOE_SHAPE

CACHE = Path(__file__).resolve().parent / ".cache"
RESULTS = Path(__file__).resolve().parent / "results" / "kv_tiers.json"
BLOCK_SIZE = 16
MAX_NUM_SEQS = 4          # one request runs at a time; a hybrid prefill step captures up to this many snapshots
MIB = 2**20

MOE_SHAPE = dict(QWEN3_MOE_SHAPE, max_position_embeddings=4096)
HYBRID_SHAPE = dict(  # Qwen3.5-MoE's layout scaled down (as bench_qwen3_next's Qwen3-Next shape)
    vocab_size=8192, hidden_size=512, num_hidden_layers=8, full_attention_interval=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, max_position_embeddings=4096, tie_word_embeddings=False,
)

logger = logging.getLogger("bench_kv_tiers")


@dataclass(frozen=True)
class BenchModel:
    name: str
    config_class: str
    architecture: str
    shape: dict
    full_kv_bytes_per_token: int     # the device pool's bytes per cached token (full-attention layers, float32)
    state_bytes_per_row: int = 0     # a recurrent-state slot's or snapshot's bytes (linear-attention layers, float32)

    def checkpoint(self) -> Path:
        path = CACHE / f"{self.name}-kvtiers-float32"
        if not (path / "config.json").exists():
            import transformers

            logger.info("building the %s checkpoint in %s", self.name, path)
            config = getattr(transformers, self.config_class)(**self.shape, initializer_range=0.05)
            save_random_checkpoint(config, self.architecture, path)
        return path


def kv_bytes_per_token(shape: dict, full_layers: int) -> int:
    return full_layers * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 4


def linear_state_bytes(shape: dict) -> int:
    """One state row of every Gated DeltaNet layer: the delta-rule matrix per value head, and the convolution's
    inputs (kernel entries, a bound) over q, k and v."""
    layers = shape["num_hidden_layers"] - shape["num_hidden_layers"] // shape["full_attention_interval"]
    delta = shape["linear_num_value_heads"] * shape["linear_key_head_dim"] * shape["linear_value_head_dim"]
    conv_dim = (2 * shape["linear_num_key_heads"] * shape["linear_key_head_dim"]
                + shape["linear_num_value_heads"] * shape["linear_value_head_dim"])
    return layers * (delta + conv_dim * shape["linear_conv_kernel_dim"]) * 4


MODELS = {
    "moe": BenchModel("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE_SHAPE,
                      kv_bytes_per_token(MOE_SHAPE, MOE_SHAPE["num_hidden_layers"])),
    "hybrid": BenchModel("qwen3_5moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", HYBRID_SHAPE,
                         kv_bytes_per_token(HYBRID_SHAPE, HYBRID_SHAPE["num_hidden_layers"]
                                            // HYBRID_SHAPE["full_attention_interval"]),
                         linear_state_bytes(HYBRID_SHAPE)),
}


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    first_prompt: int
    user_tokens: int
    new_tokens: int
    vocab: int

    @property
    def final_history(self) -> int:
        """Tokens of a conversation's last request, its generated tokens included."""
        return self.first_prompt + (self.turns - 1) * (self.new_tokens + self.user_tokens) + self.new_tokens

    def user_message(self, conversation: int, turn: int) -> list[int]:
        length = self.first_prompt if turn == 0 else self.user_tokens
        generator = torch.Generator().manual_seed(1000 * conversation + turn)
        return torch.randint(100, self.vocab, (length,), generator=generator).tolist()


@dataclass(frozen=True)
class TierRun:
    name: str
    host_bytes: int
    disk_bytes: int              # 0: no disk tier


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(round(q * (len(ordered) - 1))), len(ordered) - 1)]


def serve_turn(engine, request_id: str, prompt: list[int], params) -> tuple[float, object]:
    """One request alone on `engine`: (seconds from submission to its first token's sampling, its last output)."""
    submitted = time.time()
    engine.add_request(request_id, prompt, params)
    first_token_at = None
    while True:
        for out in engine.step():
            if first_token_at is None and out.token_ids:
                first_token_at = out.sampled_at or time.time()
            if out.finished:
                return first_token_at - submitted, out


def run_conversations(path: str, workload: Workload, runs: list[TierRun], kv_cache_memory: int, queue) -> None:
    """Every tier configuration's engine in this one process, each turn of each conversation served on one engine
    after the other (round robin over conversations, one request at a time): a machine shared with other work
    slows every configuration alike instead of whichever ran during a busy minute."""
    from moe_runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=workload.new_tokens, temperature=0.0, ignore_eos=True)
    with contextlib.ExitStack() as stack:
        engines = {}
        for run in runs:
            tier_options = dict(kv_host_memory=run.host_bytes)
            if run.disk_bytes:
                disk_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kv-tiers-bench-"))
                tier_options.update(kv_disk_dir=disk_dir, kv_disk_size=run.disk_bytes)
            llm = stack.enter_context(LLM(path, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                          kv_cache_memory=kv_cache_memory, max_num_seqs=MAX_NUM_SEQS,
                                          max_num_batched_tokens=4096, **tier_options))
            llm.generate([[7] * 40], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))   # warm-up
            llm.engine.reset_prefix_cache()
            engines[run.name] = llm.engine
        before = {name: engine.stats().workers[0] for name, engine in engines.items()}
        histories = {name: [[] for _ in range(workload.conversations)] for name in engines}
        requests = {name: [] for name in engines}
        busy_s = {name: 0.0 for name in engines}
        for turn in range(workload.turns):
            for conversation in range(workload.conversations):
                message = workload.user_message(conversation, turn)
                for name, engine in engines.items():
                    prompt = histories[name][conversation] + message
                    started = time.perf_counter()
                    ttft_s, output = serve_turn(engine, f"c{conversation}-t{turn}", prompt, params)
                    busy_s[name] += time.perf_counter() - started
                    histories[name][conversation] = prompt + list(output.token_ids)
                    requests[name].append(dict(conversation=conversation, turn=turn, prompt_tokens=len(prompt),
                                               cached_tokens=output.cached_prompt_tokens, ttft_s=ttft_s,
                                               tokens=list(output.token_ids)))
        after = {name: engine.stats().workers[0] for name, engine in engines.items()}
    results = {}
    for name in engines:
        results[name] = dict(
            requests=requests[name], serve_s=busy_s[name],
            prompt_tokens=sum(r["prompt_tokens"] for r in requests[name]),
            device_hit_tokens=after[name].prefix_cache_hits - before[name].prefix_cache_hits,
            tier_hit_tokens=after[name].kv_tier_hit_tokens - before[name].kv_tier_hit_tokens,
            kv_blocks_total=after[name].kv_blocks_total, tiers=[asdict(t) for t in after[name].kv_tiers])
    queue.put(dict(results=results, load_average=os.getloadavg()))


def summarize(result: dict) -> dict:
    requests = result["requests"]
    returning = [r["ttft_s"] for r in requests if r["turn"] > 0]
    every = [r["ttft_s"] for r in requests]
    # prefix_cache_hits counts what the device pool held and what came back from the tiers (the block manager
    # registers a loaded prefix as cached): the tiers' share is kv_tier_hit_tokens
    hits = result["device_hit_tokens"]
    return dict(
        ttft_p50_ms=1000 * statistics.median(every), ttft_p99_ms=1000 * percentile(every, 0.99),
        returning_ttft_p50_ms=1000 * statistics.median(returning) if returning else None,
        returning_ttft_p99_ms=1000 * percentile(returning, 0.99) if returning else None,
        prompt_tokens=result["prompt_tokens"], cached_prompt_tokens=hits, tier_hit_tokens=result["tier_hit_tokens"],
        reported_cached_tokens=sum(r["cached_tokens"] for r in requests),
        prefill_tokens_computed=result["prompt_tokens"] - hits, serve_s=result["serve_s"],
        kv_blocks_total=result["kv_blocks_total"], tiers=result["tiers"],
    )


def bench_model(model: BenchModel, workload: Workload, device_share: float) -> dict:
    path = str(model.checkpoint())
    history_bytes = workload.conversations * workload.final_history * model.full_kv_bytes_per_token
    device_tokens = int(device_share * workload.conversations * workload.final_history)
    # at least one whole conversation and a few blocks: the running request must fit
    pool_tokens = max(device_tokens, workload.final_history + 4 * BLOCK_SIZE)
    kv_cache_memory = -(-pool_tokens * model.full_kv_bytes_per_token // MIB) * MIB
    # the recurrent-state slots, their scratch row and the snapshot rows (one per slot) come out of the budget first
    kv_cache_memory += (2 * MAX_NUM_SEQS + 1) * model.state_bytes_per_row
    # what the tiers get: every history's blocks, and on the hybrid model the snapshots each turn's prefill and
    # decode capture (up to max_num_seqs + 1 a turn)
    snapshot_bytes = workload.conversations * workload.turns * (MAX_NUM_SEQS + 1) * model.state_bytes_per_row
    tier_bytes = history_bytes + snapshot_bytes
    host_all = 2 * tier_bytes + 64 * MIB               # keeps everything: host alone serves every return
    host_quarter = -(-tier_bytes // 4 // MIB) * MIB    # keeps the last quarter: most returns come from the disk
    runs = [TierRun("off", 0, 0), TierRun("host", host_all, 0), TierRun("host+disk", host_quarter, 2 * host_all)]
    started = time.perf_counter()
    measured = in_subprocess(run_conversations, path, workload, runs, kv_cache_memory)
    results, summaries = measured["results"], {}
    for run in runs:
        summaries[run.name] = dict(summarize(results[run.name]), host_bytes=run.host_bytes, disk_bytes=run.disk_bytes)
        s = summaries[run.name]
        print(f"{model.name} {run.name:>9}: TTFT p50 {s['ttft_p50_ms']:7.1f} ms p99 {s['ttft_p99_ms']:7.1f} ms "
              f"(returning turns p50 {s['returning_ttft_p50_ms']:7.1f} ms), prefill computed "
              f"{s['prefill_tokens_computed']} of {s['prompt_tokens']} tokens ({s['tier_hit_tokens']} from the "
              f"tiers), busy {s['serve_s']:.0f} s", flush=True)
    print(f"{model.name}: {time.perf_counter() - started:.0f} s, load average {measured['load_average']}")
    baseline = [r["tokens"] for r in results["off"]["requests"]]
    for name, result in results.items():
        if [r["tokens"] for r in result["requests"]] != baseline:
            mismatch = next(r for r, b in zip(result["requests"], baseline) if r["tokens"] != b)
            raise SystemExit(f"{model.name} {name}: greedy tokens differ from the run without tiers "
                             f"(first at conversation {mismatch['conversation']} turn {mismatch['turn']})")
    off = summaries["off"]
    for name, s in summaries.items():
        s["ttft_p50_speedup"] = off["ttft_p50_ms"] / s["ttft_p50_ms"]
        s["ttft_p99_speedup"] = off["ttft_p99_ms"] / s["ttft_p99_ms"]
        s["returning_ttft_p50_speedup"] = off["returning_ttft_p50_ms"] / s["returning_ttft_p50_ms"]
        s["prefill_tokens_ratio"] = s["prefill_tokens_computed"] / off["prefill_tokens_computed"]
        s["serve_time_speedup"] = off["serve_s"] / s["serve_s"]
    per_turn = {name: [statistics.median(1000 * r["ttft_s"] for r in result["requests"] if r["turn"] == t)
                       for t in range(workload.turns)] for name, result in results.items()}
    return dict(model=model.name, architecture=model.architecture, shape=model.shape,
                full_kv_bytes_per_token=model.full_kv_bytes_per_token, kv_cache_memory=kv_cache_memory,
                device_pool_tokens=summaries["off"]["kv_blocks_total"] * BLOCK_SIZE,
                history_tokens=workload.conversations * workload.final_history,
                tokens_equal=True, load_average_after=measured["load_average"], runs=summaries,
                ttft_p50_ms_by_turn=per_turn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["moe", "hybrid"], choices=sorted(MODELS))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-prompt", type=int, default=500)
    parser.add_argument("--user-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--device-share", type=float, default=1 / 8,
                        help="the device pool's size as a share of every conversation's final history")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for name in args.models:
        model = MODELS[name]
        workload = Workload(args.conversations, args.turns, args.first_prompt, args.user_tokens, args.new_tokens,
                            model.shape["vocab_size"])
        rows.append(bench_model(model, workload, args.device_share))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="kv_tiers", command="python bench/" + Path(__file__).name + " " + " ".join(sys.argv[1:]),
        workload=dict(conversations=args.conversations, turns=args.turns, first_prompt=args.first_prompt,
                      user_tokens=args.user_tokens, new_tokens=args.new_tokens, device_share=args.device_share,
                      block_size=BLOCK_SIZE),
        notes=("Histories scaled down to run on a 2-core CPU in about ten minutes (first prompt "
               f"{args.first_prompt} tokens, up to {rows[0]['history_tokens'] // args.conversations if rows else 0} "
               "per conversation); one request at a time, so TTFT is prefill (plus a tier load) without queueing. "
               "The first turn of each conversation is cold in every run: returning_* covers turns >= 1."),
        machine=dict(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                     torch=torch.__version__, load_average=os.getloadavg()),
        rows=rows), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
