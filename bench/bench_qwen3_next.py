"""Qwen3-Next: this runtime vs transformers `generate` on the same Qwen3-Next-shaped bench checkpoint, prefill and
decode tok/s side by side in one run.

The checkpoint (built once, cached under bench/.cache) is Qwen3-Next-80B-A3B's shape scaled down to run on a
small CPU: its layer pattern (three Gated DeltaNet layers, then one gated full attention: 8 layers, 6 linear),
its head ratios (16 query : 2 KV heads of the full layers -> 8 : 1; 16 key : 32 value heads of the linear
layers -> 4 : 8), its partial rotary (1/4), its MoE on every layer with top-10 routing and a gated shared
expert (512 experts -> 64), random weights (moe_runtime.weights.random_weights), float32.

Prefill tok/s: prompt tokens over the time of a 1-token generate of the batch (each system's prefill and one
sampling). Decode tok/s: the generated tokens after the first over the time an `NEW_TOKENS`-token generate
takes beyond the 1-token one. Prompts are `PROMPT_LEN` tokens (four delta-rule chunks of 64). Each system runs in
its own process (peak RSS per system), best of `--repeats`; greedy tokens are compared too (a random
checkpoint's near-ties may differ in the last places; `tokens_equal` says). Writes bench/results/qwen3_next.json.

    python bench/bench_qwen3_next.py [--batches 1 4] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo root, for bench.*

from bench.bench_offline import in_subprocess
from bench.random_checkpoint import save_random_checkpoint

CACHE = Path(__file__).resolve().parent / ".cache"
RESULTS = Path(__file__).resolve().parent / "results" / "qwen3_next.json"
SHAPE = dict(  # Qwen3-Next-80B-A3B (hidden 2048, 48 layers, 512 experts) scaled down, its ratios kept
    vocab_size=8192, hidden_size=512, num_hidden_layers=8, full_attention_interval=4,
    num_attention_heads=8, num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, intermediate_size=1024, decoder_sparse_step=1, norm_topk_prob=True,
    max_position_embeddings=4096, tie_word_embeddings=False,
)
PROMPT_LEN = 256
NEW_TOKENS = 32

logger = logging.getLogger("bench_qwen3_next")


def build_checkpoint() -> Path:
    path = CACHE / "qwen3next-bench-float32"
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3NextConfig

    logger.info("building the checkpoint in %s", path)
    return save_random_checkpoint(Qwen3NextConfig(**SHAPE, initializer_range=0.05), "Qwen3NextForCausalLM", path)


def make_prompts(batch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(100, SHAPE["vocab_size"], (batch, PROMPT_LEN), generator=generator).tolist()


def rates(one_token_s: float, all_tokens_s: float, batch: int) -> dict:
    """Prefill and decode tok/s from the two timings; decode is NaN (JSON null) when noise made the longer run
    no longer (a machine shared with other work: rerun)."""
    decode_s = all_tokens_s - one_token_s
    return dict(prefill_tok_s=batch * PROMPT_LEN / one_token_s,
                decode_tok_s=batch * (NEW_TOKENS - 1) / decode_s if decode_s > 0 else float("nan"),
                prefill_s=one_token_s, generate_s=all_tokens_s)


def run_runtime(path: str, prompts, repeats: int, queue) -> None:
    from moe_runtime import LLM, SamplingParams

    def timed(llm, max_tokens: int):
        started = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - started, outputs

    with LLM(path, device="cpu", dtype="float32", max_num_seqs=len(prompts),
             max_num_batched_tokens=len(prompts) * PROMPT_LEN) as llm:
        timed(llm, 4)                                           # warm-up
        one = min(timed(llm, 1)[0] for _ in range(repeats))
        runs = [timed(llm, NEW_TOKENS) for _ in range(repeats)]
    queue.put(dict(**rates(one, min(s for s, _ in runs), len(prompts)), tokens=[o.token_ids for o in runs[-1][1]],
                   peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def run_transformers(path: str, prompts, repeats: int, queue) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    input_ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(input_ids))

    def timed(max_tokens: int):
        started = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        return time.perf_counter() - started, out

    with torch.no_grad():
        timed(4)                                                # warm-up
        one = min(timed(1)[0] for _ in range(repeats))
        runs = [timed(NEW_TOKENS) for _ in range(repeats)]
    queue.put(dict(**rates(one, min(s for s, _ in runs), len(prompts)), tokens=runs[-1][1][:, PROMPT_LEN:].tolist(),
                   peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = str(build_checkpoint())
    rows = []
    for batch in args.batches:
        prompts = make_prompts(batch)
        ours = in_subprocess(run_runtime, path, prompts, args.repeats)
        theirs = in_subprocess(run_transformers, path, prompts, args.repeats)
        row = dict(batch=batch, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
                   tokens_equal=ours.pop("tokens") == theirs.pop("tokens"),
                   runtime={k: round(v, 3) for k, v in ours.items()},
                   transformers={k: round(v, 3) for k, v in theirs.items()},
                   prefill_ratio=round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 2),
                   decode_ratio=round(ours["decode_tok_s"] / theirs["decode_tok_s"], 2))
        rows.append(row)
        print(f"batch {batch:>2}: prefill {ours['prefill_tok_s']:8.1f} vs {theirs['prefill_tok_s']:8.1f} tok/s "
              f"(x{row['prefill_ratio']}), decode {ours['decode_tok_s']:7.1f} vs {theirs['decode_tok_s']:7.1f} tok/s "
              f"(x{row['decode_ratio']}), tokens equal: {row['tokens_equal']}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(dict(load_average=os.getloadavg(),
        checkpoint=dict(SHAPE, architecture="Qwen3NextForCausalLM", dtype="float32"),
        machine=dict(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                     torch=torch.__version__),
        rows=rows), indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
