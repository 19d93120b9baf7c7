"""Speculative decoding: acceptance length and decode tok/s, with and without it, side by side in one run.

`--method ngram` (prompt lookup) runs on the bench checkpoint (bench/bench_offline.py builds it: Qwen3-MoE-shaped,
random weights); `--method mtp` on a DeepSeek-V3-shaped one with an MTP layer (bench/deepseek_mtp_checkpoint.py)
trained on the target's own greedy outputs (bench/mtp_training.py), so that its acceptance means something;
`--mtp-head random` keeps the layer random instead: that row measures what the drafter costs (its pass over each
step's rows, the chain, the wider verify steps) with almost nothing accepted. The trained layer memorises its 48
training sequences rather than generalising (the random target's continuations carry no structure a small
layer learns from 9k positions): on the bench's prompts it too accepts nothing, so `--seen` runs the
comparison on its training prompts, where its drafts are accepted: the drafter's gain when it predicts.
`--captured` runs both sides with the captured decode step (`enable_torch_compile`, inductor): plain decodes and
verify steps alike go through its graphs.

The prompt is shaped like a code edit: a "file" of 160 tokens, a short instruction, then the file again up to
the point being edited, so that the context repeats itself (what n-gram lookup feeds on). Greedy, eos ignored;
batches 1 and 4 (the same prompt shape, different files). Decode tok/s is the generated tokens after the
first over the time after the first (a max_tokens=1 run of the same prompts times the prefill); the acceptance
length is the tokens a verifying sequence-step emits on average (1 + accepted / verify steps). A random model
repeats itself only where its own greedy output loops, so the acceptance here is a floor of what a trained
model editing code gets.

    python bench/bench_speculative.py [--method ngram|mtp] [--mtp-head trained|random] [--seen] [--captured]
                                      [--batches 1 4]
                                      [--new-tokens 128] [--k 3] [--min 1] [--max 3]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.bench_offline import build_checkpoint
from bench.deepseek_mtp_checkpoint import build_mtp_checkpoint
from bench.mtp_training import build_trained_mtp_checkpoint

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FILE_TOKENS = 160
INSTRUCTION = [11, 12, 13, 14, 15, 16, 17, 18]


def edit_prompts(count: int, vocab: int = 4096) -> list[list[int]]:
    """File + instruction + the file again up to two thirds (the edit point), one file per request."""
    prompts = []
    for index in range(count):
        generator = torch.Generator().manual_seed(1000 + index)
        file = torch.randint(20, vocab, (FILE_TOKENS,), generator=generator).tolist()
        prompts.append(file + INSTRUCTION + file[: 2 * FILE_TOKENS // 3])
    return prompts


def seen_prompts(count: int) -> list[list[int]]:
    """The prompts the MTP layer was trained on (bench/mtp_training.py): its drafts are accepted there only."""
    from bench.mtp_training import PROMPT_TOKENS, training_sequences

    return [row[:PROMPT_TOKENS] for row in training_sequences()[:count].tolist()]


def measure(path: Path, batch: int, new_tokens: int, speculative: dict | None, seen: bool = False,
            captured: bool = False) -> dict:
    from moe_runtime import LLM, SamplingParams

    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    prompts = seen_prompts(batch) if seen else edit_prompts(batch)
    with LLM(str(path), device="cpu", dtype="float32", enable_prefix_caching=False,
             speculative_config=speculative, enable_torch_compile=captured, torch_compile_max_bs=16) as llm:
        llm.generate(edit_prompts(1), greedy(4))                       # warm-up
        if captured:   # every bucket the run may use compiles here, not inside the timed runs
            llm.generate(prompts, greedy(new_tokens))
        capture = llm.core.runner.capture
        captured_before = (capture.stats.captured_steps, capture.stats.captured_verify_steps) if capture else None
        started = time.perf_counter()
        llm.generate(prompts, greedy(1))
        prefill_s = time.perf_counter() - started
        before = llm.engine.stats().workers[0]
        started = time.perf_counter()
        outputs = llm.generate(prompts, greedy(new_tokens))
        total_s = time.perf_counter() - started
        after = llm.engine.stats().workers[0]
        captured_after = (capture.stats.captured_steps, capture.stats.captured_verify_steps) if capture else None
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    verify_steps = after.spec_verify_steps - before.spec_verify_steps
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "batch": batch, "new_tokens": new_tokens, "speculative_config": speculative,
        "decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 2),
        "total_s": round(total_s, 3), "prefill_s": round(prefill_s, 3),
        "steps": after.steps - before.steps,
        "drafted": drafted, "accepted": accepted, "verify_steps": verify_steps,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "acceptance_length": round(1 + accepted / verify_steps, 3) if verify_steps else None,
        "captured_steps": captured_after[0] - captured_before[0] if capture else None,   # in the timed runs
        "captured_verify_steps": captured_after[1] - captured_before[1] if capture else None,
        "token_ids": [o.token_ids for o in outputs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["ngram", "mtp"], default="ngram")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--min", type=int, default=1, help="prompt_lookup_min")
    parser.add_argument("--max", type=int, default=3, help="prompt_lookup_max")
    parser.add_argument("--mtp-head", choices=["trained", "random"], default="trained")
    parser.add_argument("--seen", action="store_true", help="mtp: the trained layer's own training prompts")
    parser.add_argument("--captured", action="store_true", help="both sides with the captured decode step")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    if args.method == "mtp":
        path = build_trained_mtp_checkpoint() if args.mtp_head == "trained" else build_mtp_checkpoint()
        speculative = {"method": "mtp", "num_speculative_tokens": args.k}
    else:
        path, speculative = build_checkpoint("float32"), {"method": "ngram", "num_speculative_tokens": args.k,
                                                          "prompt_lookup_min": args.min, "prompt_lookup_max": args.max}
    rows = []
    print(f"{'batch':>5} {'plain tok/s':>12} {args.method + ' tok/s':>12} {'speedup':>8} {'accept len':>10} "
          f"{'accept rate':>11}")
    for batch in args.batches:
        plain = measure(path, batch, args.new_tokens, None, args.seen, args.captured)
        spec = measure(path, batch, args.new_tokens, speculative, args.seen, args.captured)
        same = plain.pop("token_ids") == spec.pop("token_ids")
        speedup = spec["decode_tok_s"] / plain["decode_tok_s"]
        rows.append({"batch": batch, "plain": plain, args.method: spec, "speedup": round(speedup, 3),
                     "greedy_tokens_equal": same})
        print(f"{batch:>5} {plain['decode_tok_s']:>12.1f} {spec['decode_tok_s']:>12.1f} {speedup:>7.2f}x "
              f"{spec['acceptance_length'] or 0:>10.2f} {spec['acceptance_rate'] or 0:>11.2f}"
              + ("" if same else "  TOKENS DIFFER"))
    RESULTS.mkdir(exist_ok=True)
    random_head = args.method == "mtp" and args.mtp_head == "random"
    suffix = ("_random_head" if random_head else "") + ("_seen" if args.seen else "") + \
        ("_captured" if args.captured else "")
    out = RESULTS / f"speculative_{args.method}{suffix}.json"
    out.write_text(json.dumps({"checkpoint": path.name, "machine": platform.processor() or platform.machine(),
                               "threads": torch.get_num_threads(), "prompt": f"{FILE_TOKENS}-token file + "
                               f"{len(INSTRUCTION)}-token instruction + the file's first {2 * FILE_TOKENS // 3}",
                               "command": "python bench/bench_speculative.py " + " ".join(sys.argv[1:]),
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(row["greedy_tokens_equal"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
