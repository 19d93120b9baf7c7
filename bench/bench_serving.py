"""Serving benchmark: `moe-serve` under N concurrent streaming clients vs transformers' plain generate loop.

Starts `moe-serve` itself (the embedded demo model unless --model), then for each concurrency
level runs a closed loop of streaming clients (each sends its next request when the previous
one ends) over prompts of mixed lengths, every request generating exactly --max-tokens tokens
(ignore_eos). Reports output throughput, time to first token and inter-token latency (gaps
between streamed chunks) at p50/p99, and TPOT ((e2e - TTFT) / (tokens - 1)).

The baseline is what a user without a serving engine runs: the same checkpoint in
transformers, `model.generate` greedy, one request after another (fp32, same device). It has no
concurrency, so its row is compared with the server's at each level on throughput, and with
the server at concurrency 1 on latency. It runs before and after the server; the faster run is kept.

    python bench/bench_serving.py --threads 1          # about 1-4 minutes on 2 shared CPU cores
    python bench/bench_serving.py --levels 1,4 --max-tokens 32 --baseline-requests 4   # quick look
    git worktree add /tmp/before <commit>      # the same clients against an older checkout, side by side:
    python bench/bench_serving.py --server-args "--ep 2 --dp-attn 2" --tree /tmp/before --tree . \
        --levels 1,16,64 --baseline-requests 0 --out bench/results/serving_process_layer.json

Writes bench/results/serving.json.

Structured output (`--structured-output`): the same closed loop at 1 and 16 clients, free text
against a JSON schema (`response_format`, xgrammar), and free chat against a forced tool call
(`tool_choice: required`; its arguments, at most max_tokens/5 integers, complete so the call
streams as a client sees it), on one server; every request generates exactly
--max-tokens tokens in both modes (the schema asks for more integers than fit, so each constrained
answer is cut by max_tokens: equal work per request). The four modes alternate twice per level and
the faster run of each is kept. Then, in process, the share of the engine's
step time that structured output costs at batch 1 and 16: the bitmask fill + apply (timed inside
the sampler, `GrammarBitmask.timings`) plus the matcher advancing past each sampled token (timed by
replaying the same tokens through fresh matchers), over the engine's forward-step wall time
(`WorkerStats.step_seconds`, which includes sampling); free and constrained batches alternate twice
and the faster run of each is kept.

    python bench/bench_serving.py --structured-output --threads 1     # writes bench/results/structured_output.json
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
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.serving_load import (CHAT_MODE, PROMPT_LENGTHS, REPO_ROOT, LevelResult, RequestRecord, Server,
                                make_prompts, run_level, summarize)

logger = logging.getLogger("bench_serving")


# ---- moe-serve -------------------------------------------------------------------------------

def bench_server(model: str, device: str, levels: list[int], prompts_per_level: dict[int, list[list[int]]],
                 max_tokens: int, threads: int | None, tree: Path = REPO_ROOT,
                 extra_args: tuple[str, ...] = ()) -> list[LevelResult]:
    server = Server(model, device, max_num_seqs=max(levels), threads=threads, tree=tree, extra_args=extra_args)
    results = []
    try:
        asyncio.run(run_level(server.url, prompts_per_level[levels[0]][:2], 2, 8))  # warm-up
        for level in levels:
            prompts = prompts_per_level[level]
            logger.info("moe-serve: %d streaming clients, %d requests of %d tokens", level, len(prompts), max_tokens)
            records, duration = asyncio.run(run_level(server.url, prompts, level, max_tokens))
            result = summarize("moe-serve", level, records, duration)
            if result.failed:
                errors = {r.error for r in records if r.error}
                logger.warning("%d requests failed: %s", result.failed, sorted(errors)[:3])
            logger.info("  %.1f tok/s, TTFT p50 %.0f ms, ITL p50 %.1f ms", result.throughput_tok_s,
                        result.ttft_p50_ms, result.itl_p50_ms)
            results.append(result)
    finally:
        server.stop()
    return results


# ---- the transformers baseline ----------------------------------------------------------------

class TokenTimes:
    """A `generate` streamer that only records when each new token appears (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_hf(model_path: str, device: str, prompts: list[list[int]], max_tokens: int,
             threads: int | None) -> LevelResult:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if threads:
        torch.set_num_threads(threads)

    torch_device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                ("cpu" if device == "auto" else device))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(torch_device).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              eos_token_id=None, pad_token_id=model.config.pad_token_id)
    records = []
    with torch.inference_mode():
        warm = torch.tensor([prompts[0][:8]], device=torch_device)
        model.generate(warm, attention_mask=torch.ones_like(warm), generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=2, eos_token_id=None, pad_token_id=model.config.pad_token_id))
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            logger.info("transformers generate: request %d/%d (%d prompt tokens)", i + 1, len(prompts), len(prompt))
            ids = torch.tensor([prompt], device=torch_device)                    # [1, T]
            times = TokenTimes()
            record = RequestRecord(len(prompt), time.perf_counter())
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=times)
            record.end = time.perf_counter()
            record.completion_tokens = out.shape[1] - ids.shape[1]
            record.first_token = times.times[0]
            record.chunk_times = times.times
            records.append(record)
        duration = time.perf_counter() - start
    return summarize("transformers generate (sequential)", 1, records, duration)


# ---- structured output --------------------------------------------------------------------------

def long_json_schema(max_tokens: int) -> dict:
    """An object whose one array needs more integers than max_tokens can hold: every answer is cut by
    max_tokens, so free and constrained requests generate the same number of tokens."""
    return {"type": "object", "properties": {"readings": {"type": "array", "minItems": max_tokens,
                                                          "items": {"type": "integer", "minimum": 0, "maximum": 999}}},
            "required": ["readings"], "additionalProperties": False}


@dataclass
class BitmaskShare:
    batch: int
    steps: int
    step_seconds: float               # the engine's forward steps (sampling included), wall time
    bitmask_seconds: float            # filling + applying the token bitmasks (in the sampler)
    accept_seconds: float             # advancing the matchers past the sampled tokens (replayed)
    free_step_seconds: float          # the same batch without a schema, for comparison
    share: float                      # (bitmask + accept) / step time

    @property
    def row(self) -> str:
        step_ms, free_ms = 1e3 * self.step_seconds / self.steps, 1e3 * self.free_step_seconds / self.steps
        mask_us, accept_us = 1e6 * self.bitmask_seconds / self.steps, 1e6 * self.accept_seconds / self.steps
        return (f"batch {self.batch:>3}: step {step_ms:6.2f} ms (free text {free_ms:6.2f} ms), bitmask {mask_us:7.1f} "
                f"us + accept {accept_us:6.1f} us per step = {100 * self.share:.2f}% of step time")


def measure_bitmask_share(model: str, device: str, batches: list[int], max_tokens: int, threads: int | None,
                          schema: dict) -> list[BitmaskShare]:
    """In process (one rank): the structured-output cost inside the engine's step, at each batch size."""
    import torch

    from moe_runtime import LLM, SamplingParams
    from moe_runtime.sampling.structured_output.grammar_state import GrammarState
    from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec

    if threads:
        torch.set_num_threads(threads)
    spec = StructuredOutputSpec(json_schema=json.dumps(schema))
    shares = []
    with LLM(model, device=device, max_num_seqs=max(batches)) as llm:
        core = llm.core
        prompts = make_prompts(max(batches), core.vocab_size, seed=7)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_output=spec))   # warm-up, compiles
        for batch in batches:
            def run(structured: bool):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                        structured_output=spec if structured else None)
                steps, seconds = core.worker_stats().steps, core.worker_stats().step_seconds
                masked = core.sampler.grammar_bitmask.timings.seconds
                outputs = llm.generate(prompts[:batch], params)
                return (outputs, core.worker_stats().steps - steps, core.worker_stats().step_seconds - seconds,
                        core.sampler.grammar_bitmask.timings.seconds - masked)

            # alternated twice, the faster run of each kept: the load of a shared machine drifts
            runs = [run(structured) for structured in (False, True, False, True)]
            _, free_steps, free_seconds, _ = min(runs[0::2], key=lambda r: r[2])
            outputs, steps, seconds, masked = min(runs[1::2], key=lambda r: r[2])
            compiled = core.grammars.compile(spec)
            states = [GrammarState.start(compiled) for _ in outputs]
            started = time.perf_counter()
            for state, output in zip(states, outputs):
                for token in output.token_ids:
                    state.matcher.accept_token(token)
            accepted = time.perf_counter() - started
            shares.append(BitmaskShare(batch, steps, seconds, masked, accepted, free_seconds * steps / free_steps,
                                       (masked + accepted) / seconds))
            logger.info("structured output in process: %s", shares[-1].row)
    return shares


def bench_structured_output(args, model: str, config: dict) -> int:
    levels = [int(x) for x in (args.levels or "1,16").split(",")]
    schema = long_json_schema(args.max_tokens)
    structured = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "readings", "schema": schema, "strict": True}}}
    # a call that completes within max_tokens, so its name and argument fragments stream as a client sees them
    call_schema = {**schema, "properties": {"readings": {**schema["properties"]["readings"], "minItems": 1,
                                                          "maxItems": max(1, args.max_tokens // 5)}}}
    tool = {"type": "function", "function": {"name": "record_readings", "parameters": call_schema}}
    modes = (("free text", None), ("json schema", structured), ("chat free text", {CHAT_MODE: True}),
             ("chat tool call (required)", {CHAT_MODE: True, "tools": [tool], "tool_choice": "required",
                                            "parallel_tool_calls": False}))
    started = time.perf_counter()
    server = Server(model, args.device, max_num_seqs=max(levels), threads=args.threads,
                    extra_args=tuple(args.server_args.split()))
    rows = []
    try:
        for _, extra in modes[1::2]:  # warm-up: compiles the schema and the forced tool-call schema
            asyncio.run(run_level(server.url, make_prompts(2, config["vocab_size"]), 2, 8, extra))
        for level in levels:
            prompts = make_prompts(max(args.min_requests, level * args.requests_per_client), config["vocab_size"],
                                   seed=level)
            best: dict[str, LevelResult] = {}
            for name, extra in modes * 2:   # alternated, the faster run of each kept
                records, duration = asyncio.run(run_level(server.url, prompts, level, args.max_tokens, extra))
                result = summarize(name, level, records, duration)
                if result.failed:
                    errors = sorted({r.error for r in records if r.error})
                    logger.warning("%d requests failed: %s", result.failed, errors[:3])
                logger.info("%s, %d clients: %.1f tok/s, ITL p50 %.1f ms", name, level, result.throughput_tok_s,
                            result.itl_p50_ms)
                if name not in best or result.throughput_tok_s > best[name].throughput_tok_s:
                    best[name] = result
            rows += [best[name] for name, _ in modes]
    finally:
        server.stop()
    shares = measure_bitmask_share(model, args.device, levels, args.max_tokens, args.threads, schema)
    print()
    print_table(rows, None)
    ratios = constrained_vs_free(rows, len(modes))
    for level, ratio in ratios.items():
        print(f"{level:>3} clients: json schema / free text = {ratio['json_schema_vs_free_text']:.3f}, "
              f"tool call / chat free text = {ratio['tool_call_vs_chat_free_text']:.3f}")
    for share in shares:
        print(share.row)
    report = {
        "benchmark": "structured_output",
        "model": model if args.model else "embedded demo model (DeepSeek-V3 style, random weights)",
        "architecture": config.get("architectures", ["?"])[0],
        "vocab_size": config["vocab_size"],
        "device": args.device,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "schema": schema,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "tree": tree_label(REPO_ROOT),
        "wall_s": time.perf_counter() - started,
        "server": [asdict(r) for r in rows],
        "throughput_ratios": ratios,
        "bitmask_share_of_step_time": [asdict(share) for share in shares],
        "how_measured": "server rows: closed loop of streaming clients, every request exactly max_tokens tokens "
                        "(the schema is longer than max_tokens), except the forced tool call, whose arguments "
                        "(at most max_tokens/5 integers) complete so that the call streams as clients see it: "
                        "throughput is tokens per second over what each request generated; the four modes alternated twice, the faster run of each kept; tool calls are "
                        "compared with free chat on the same messages; bitmask share: one in-process engine, greedy batch "
                        "of N constrained requests; (sampler bitmask fill+apply time + matcher accept time replayed "
                        "on the same tokens) / the engine's step wall time (forward + sampling)",
    }
    out = args.out or REPO_ROOT / "bench" / "results" / "structured_output.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def constrained_vs_free(rows: list[LevelResult], modes_per_level: int) -> dict[str, dict[str, float]]:
    """Per client count: JSON schema over free text (completions), forced tool call over free chat."""
    ratios = {}
    for start in range(0, len(rows), modes_per_level):
        free, json_schema, chat, tool_call = rows[start:start + modes_per_level]
        ratios[str(free.concurrency)] = {
            "json_schema_vs_free_text": json_schema.throughput_tok_s / free.throughput_tok_s,
            "tool_call_vs_chat_free_text": tool_call.throughput_tok_s / chat.throughput_tok_s}
    return ratios


# ---- report ------------------------------------------------------------------------------------

def print_table(server: list[LevelResult], baseline: LevelResult | None) -> None:
    header = (f"{'engine':<36} {'clients':>7} {'reqs':>5} {'tok/s':>8} {'x base':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'TPOT':>7}")
    print(header)
    print("-" * len(header))
    rows = ([baseline] if baseline else []) + server
    for r in rows:
        ratio = r.throughput_tok_s / baseline.throughput_tok_s if baseline else float("nan")
        print(f"{r.name:<36} {r.concurrency:>7} {r.requests - r.failed:>5} {r.throughput_tok_s:>8.1f} {ratio:>6.2f}x "
              f"{r.ttft_p50_ms:>7.0f}ms {r.ttft_p99_ms:>7.0f}ms {r.itl_p50_ms:>6.1f}ms {r.itl_p99_ms:>6.1f}ms "
              f"{r.tpot_mean_ms:>5.1f}ms")
    print("(ms; ITL = gaps between streamed chunks; TPOT = (e2e - TTFT) / (tokens - 1); x base = throughput ratio)")


def tree_label(tree: Path) -> str:
    """A checkout's short commit (and whether it has uncommitted changes)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF checkpoint directory; default: the embedded demo model")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--levels", default=None,
                        help="comma-separated client counts; default 1,4,16,64 (1,16 with --structured-output)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests per client at each level")
    parser.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    parser.add_argument("--baseline-requests", type=int, default=8, help="sequential transformers requests")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for both the server and the baseline (default: torch's choice); "
                             "1 gives steadier figures on a shared machine")
    parser.add_argument("--server-args", default="",
                        help="extra moe-serve flags, e.g. '--ep 2 --dp-attn 2' (the multi-process front)")
    parser.add_argument("--tree", type=Path, action="append", default=None,
                        help="checkout whose moe-serve to run (repeat to compare checkouts side by side, in "
                             "alternating order; e.g. a `git worktree` of an older commit); default: this one")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/serving.json (structured_output.json with --structured-output)")
    parser.add_argument("--structured-output", action="store_true",
                        help="free text vs a JSON schema at 1 and 16 clients (or --levels), and the bitmask's share "
                             "of the engine's step time")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if args.model is None:
        from moe_runtime.demo.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    else:
        model = str(Path(args.model).resolve())
    config = json.loads((Path(model) / "config.json").read_text())
    if args.structured_output:
        return bench_structured_output(args, model, config)
    levels = [int(x) for x in (args.levels or "1,4,16,64").split(",")]
    prompts_per_level = {level: make_prompts(max(args.min_requests, level * args.requests_per_client),
                                             config["vocab_size"], seed=level) for level in levels}
    started = time.perf_counter()
    baseline_prompts = make_prompts(args.baseline_requests, config["vocab_size"], seed=99)
    # The baseline runs before and after the server and keeps its faster run: on a shared machine the
    # load changes over minutes, and the comparison should not flatter the server.
    baseline_runs = []
    if args.baseline_requests > 0:
        baseline_runs.append(bench_hf(model, args.device, baseline_prompts, args.max_tokens, args.threads))
    trees = [tree.resolve() for tree in (args.tree or [REPO_ROOT])]
    extra_args = tuple(args.server_args.split())
    server_results = []
    for level_index, level in enumerate(levels):  # trees alternate their order from level to level
        order = trees if level_index % 2 == 0 else trees[::-1]
        for tree in order:
            for result in bench_server(model, args.device, [level], prompts_per_level, args.max_tokens, args.threads,
                                       tree, extra_args):
                if len(trees) > 1:
                    result.name = f"moe-serve ({tree_label(tree)})"
                server_results.append(result)
    server_results.sort(key=lambda r: (r.name, r.concurrency))
    if args.baseline_requests > 0:
        baseline_runs.append(bench_hf(model, args.device, baseline_prompts, args.max_tokens, args.threads))
    baseline = max(baseline_runs, key=lambda r: r.throughput_tok_s) if baseline_runs else None
    print()
    print_table(server_results, baseline)
    report = {
        "benchmark": "serving",
        "model": model if args.model else "embedded demo model (DeepSeek-V3 style, random weights)",
        "architecture": config.get("architectures", ["?"])[0],
        "device": args.device,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "prompt_lengths": list(PROMPT_LENGTHS),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "wall_s": time.perf_counter() - started,
        "baseline": asdict(baseline) if baseline else None,
        "baseline_runs_tok_s": [r.throughput_tok_s for r in baseline_runs],
        "server_args": args.server_args,
        "trees": {tree_label(tree): str(tree) for tree in trees},
        "server": [asdict(r) for r in server_results],
        "throughput_vs_baseline": {f"{r.name}/{r.concurrency}": (r.throughput_tok_s / baseline.throughput_tok_s
                                                                 if baseline else None) for r in server_results},
    }
    out = args.out or REPO_ROOT / "bench" / "results" / "serving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
