"""Part `captured_ep`: the expert-parallel decode step captured whole, DeepEP's low-latency kernels inside.

`LLM(ep=2, dp_attn=2, a2a_backend="deepep", enable_torch_compile=True)` on a bf16 DeepSeek-V3-shaped tiny
model of hidden size 2048 (one DeepEP's low-latency kernels are built for), two CUDA devices:

  host_reads    eager decode steps with `debug_host_reads`: every worker counted its decode steps and read
                nothing from the device in them (forward + sampling; the step's one result copy excluded)
  tokens        greedy tokens of the captured engine equal the eager engine's, three prompts then one (the
                other worker idle, running its empty step eagerly beside the other's graph); every worker
                captured its decode steps, the capture never turned off, inductor skipped no CUDA graph
  speed         ms per generated token, captured vs eager (not gated: figures)

It needs two GPUs and `deep_ep`; where either is missing its checks are skipped with the reason (one H200
has one GPU). The dry run (CPU) runs the same code through the tests' DeepEP emulation on gloo
(`deepep_module="deepep_emulation"`) with torch.compile's "aot_eager" backend and no CUDA graphs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from moe_runtime.dispatch.deepep import deep_ep_importable
from engine_helpers import greedy
from moe_runtime import LLM

from .report import Outcome, RunMode, judged, passed, skipped
from .tiny_models import tiny_factory

HIDDEN = 2048
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26]]
NEW_TOKENS = 6
SPEED_NEW_TOKENS = 24
CHECKS = ("host_reads", "tokens", "speed")


@dataclass
class EpRun:
    tokens: list[list[int]]
    ms_per_token: float
    captured_steps: list[int]       # per DP worker
    decode_steps_counted: list[int]
    host_read_sites: list[dict[str, int]]


class CapturedEpPart:
    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = mode.device
        self.dry_run = mode.dry_run
        self.backend = "aot_eager" if mode.dry_run else "inductor"
        self.deepep_module = "deepep_emulation" if mode.dry_run else "deep_ep"
        self._path: Path | None = None

    def check_names(self) -> list[str]:
        return list(CHECKS)

    def close(self) -> None:
        pass

    def missing(self) -> str | None:
        """Why this machine cannot run the part (None: it can)."""
        if self.dry_run:
            return None
        if torch.cuda.device_count() < 2:
            return f"needs 2 GPUs for DeepEP between two ranks; this machine has {torch.cuda.device_count()}"
        if not deep_ep_importable(self.deepep_module):
            return "deep_ep does not import (pip install '.[deepep]')"
        return None

    def run(self, name: str) -> Outcome:
        reason = self.missing()
        if reason is not None:
            return skipped(reason)
        return {"host_reads": self.host_reads, "tokens": self.tokens, "speed": self.speed}[name]()

    def checkpoint(self) -> Path:
        if self._path is None:
            self._path = tiny_factory(self.mode.work_dir)("deepseek_v3", hidden_size=HIDDEN)
        return self._path

    def generate(self, captured: bool, new_tokens: int, **extra) -> tuple[EpRun, list[int]]:
        options = dict(enable_torch_compile=True, torch_compile_backend=self.backend) if captured else {}
        with LLM(str(self.checkpoint()), device=self.device, dtype="bfloat16", ep=2, dp_attn=2,
                 a2a_backend="deepep", deepep_module=self.deepep_module, max_num_seqs=4, **options, **extra) as llm:
            llm.generate(PROMPTS, greedy(2))                              # compiles the buckets, not timed
            started = time.perf_counter()
            tokens = [out.token_ids for out in llm.generate(PROMPTS, greedy(new_tokens))]
            elapsed = time.perf_counter() - started
            idle = llm.generate(PROMPTS[:1], greedy(new_tokens))[0].token_ids      # the other worker idles
            workers = llm.engine.stats().workers
        run = EpRun(tokens, 1000 * elapsed / new_tokens, [w.captured_decode_steps for w in workers],
                    [w.decode_steps_counted for w in workers], [w.decode_host_read_sites for w in workers])
        return run, idle

    def host_reads(self) -> Outcome:
        run, _ = self.generate(captured=False, new_tokens=NEW_TOKENS, debug_host_reads=True)
        reads = [sum(sites.values()) for sites in run.host_read_sites]
        problems = [f"worker {dp}: {count} host reads in its decode steps: {run.host_read_sites[dp]}"
                    for dp, count in enumerate(reads) if count]
        problems += [f"worker {dp}: no decode step counted" for dp, steps in enumerate(run.decode_steps_counted)
                     if not steps]
        return judged(problems, host_reads=reads, decode_steps_counted=run.decode_steps_counted)

    def tokens(self) -> Outcome:
        skips_before = int(counters["inductor"]["cudagraph_skips"])
        eager, eager_idle = self.generate(captured=False, new_tokens=NEW_TOKENS)
        captured, captured_idle = self.generate(captured=True, new_tokens=NEW_TOKENS)
        problems = []
        tokens_equal = (captured.tokens, captured_idle) == (eager.tokens, eager_idle)
        if not tokens_equal:
            problems.append("captured tokens differ from eager")
        if min(captured.captured_steps) < NEW_TOKENS - 1:
            problems.append(f"captured decode steps per worker {captured.captured_steps}, expected >= {NEW_TOKENS - 1}")
        skips = int(counters["inductor"]["cudagraph_skips"]) - skips_before
        if self.device == "cuda" and skips:
            problems.append(f"inductor skipped CUDA graphs {skips} times (see the log)")
        return judged(problems, tokens_equal=tokens_equal,
                      captured_steps=captured.captured_steps, cudagraph_skips=skips, backend=self.backend)

    def speed(self) -> Outcome:
        eager, _ = self.generate(captured=False, new_tokens=SPEED_NEW_TOKENS)
        captured, _ = self.generate(captured=True, new_tokens=SPEED_NEW_TOKENS)
        return passed(device=self.device, backend=self.backend, new_tokens=SPEED_NEW_TOKENS,
                      eager_ms_per_token=eager.ms_per_token, captured_ms_per_token=captured.ms_per_token,
                      speedup_vs_eager=eager.ms_per_token / captured.ms_per_token,
                      captured_steps=captured.captured_steps)
