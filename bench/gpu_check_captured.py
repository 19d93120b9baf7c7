"""gpu_check part `captured`: the captured decode step (`enable_torch_compile`) replayed as CUDA graphs.

On CUDA, `--enable-torch-compile` compiles each pure decode step with inductor's "reduce-overhead"
mode (moe_runtime/execution/decode_capture.py): Triton kernels replayed as one CUDA graph per batch bucket, the
block table at its full width and the KV caches as static addresses. Per architecture:

  tokens/<arch>   fp32, four prompts (bucket 4), then three (a pad row in bucket 4), greedy: tokens equal
                  the eager engine's on the same device; every decode step ran captured, the capture never
                  turned itself off, and inductor skipped no CUDA graph (its `cudagraph_skips` counter:
                  a mutated non-static input, a CPU tensor or a dynamic shape would each bump it).
  speed/<arch>    generate time per new token (its prefill step included) of the same engines, captured vs
                  eager, bf16, four sequences; not gated: figures (a tiny model's decode step is nearly all
                  launch overhead, which the graph removes).

The dry run (CPU) goes through the same code with torch.compile's "eager" backend (a trace, no
generated code: inductor's C++ compile alone would outlast the part) and no CUDA graphs, one
architecture; --tiny the same with fewer tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from engine_helpers import PROMPTS, greedy
from gpu_check_mode import RunMode
from gpu_check_outcome import Outcome, judged, passed
from moe_runtime import LLM
from moe_runtime.demo.tokenizer_training import save_tokenizer
from tiny_checkpoints import TinyCheckpointFactory, tiny_tokenizer

ARCHS = ("qwen3_moe", "deepseek_v3")   # GQA + routed experts; MLA + shared experts + a dense first layer
DRY_RUN_ARCHS = ("qwen3_moe",)
NEW_TOKENS = 16
TINY_NEW_TOKENS = 4
SPEED_NEW_TOKENS = 32
MAX_BATCH = 4                          # buckets 1, 2, 4: every step of these checks is inside one


@dataclass
class EngineRun:
    tokens: list[list[int]]
    ms_per_token: float
    captured_steps: int
    buckets: list[int]
    disabled_reason: str | None


class CapturedPart:
    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = mode.device
        self.archs = list(DRY_RUN_ARCHS if mode.dry_run or mode.tiny else ARCHS)
        self.new_tokens = TINY_NEW_TOKENS if mode.tiny else NEW_TOKENS
        self.backend = "eager" if mode.dry_run else "inductor"
        self._factory: TinyCheckpointFactory | None = None

    def check_names(self) -> list[str]:
        return [f"{kind}/{arch}" for arch in self.archs for kind in ("tokens", "speed")]

    def run(self, name: str) -> Outcome:
        kind, arch = name.split("/")
        return {"tokens": self.tokens, "speed": self.speed}[kind](arch)

    def close(self) -> None:
        pass

    def checkpoint(self, arch: str) -> Path:
        if self._factory is None:
            work = Path(self.mode.work_dir)
            self._factory = TinyCheckpointFactory(work / "tiny_checkpoints",
                                                  save_tokenizer(tiny_tokenizer(), work / "tiny_tokenizer"))
        return self._factory(arch)

    def generate(self, arch: str, dtype: str, prompts: list[list[int]], new_tokens: int, captured: bool) -> EngineRun:
        options = dict(enable_torch_compile=True, torch_compile_max_bs=MAX_BATCH,
                       torch_compile_backend=self.backend) if captured else {}
        with LLM(str(self.checkpoint(arch)), device=self.device, dtype=dtype, **options) as llm:
            llm.generate(prompts, greedy(2))                      # compiles (or warms) the bucket, not timed
            capture = llm.engine.core.runner.capture
            before = capture.stats.captured_steps if capture else 0
            self._synchronize()
            started = time.perf_counter()
            outputs = llm.generate(prompts, greedy(new_tokens))
            self._synchronize()
            elapsed = time.perf_counter() - started
            stats = capture.stats if capture else None
        return EngineRun(tokens=[o.token_ids for o in outputs],
                         ms_per_token=1000 * elapsed / new_tokens,
                         captured_steps=(stats.captured_steps - before) if stats else 0,
                         buckets=list(stats.buckets_compiled) if stats else [],
                         disabled_reason=stats.disabled_reason if stats else None)

    def tokens(self, arch: str) -> Outcome:
        problems, details = [], {"arch": arch, "device": self.device, "backend": self.backend}
        skips_before = self._cudagraph_skips()
        for label, prompts in (("four", PROMPTS[:4]), ("three_padded", PROMPTS[:3])):
            eager = self.generate(arch, "float32", prompts, self.new_tokens, captured=False)
            captured = self.generate(arch, "float32", prompts, self.new_tokens, captured=True)
            equal = captured.tokens == eager.tokens
            details[label] = {"tokens_equal": equal, "captured_steps": captured.captured_steps,
                              "buckets": captured.buckets, "disabled_reason": captured.disabled_reason}
            if not equal:
                problems.append(f"{label}: captured tokens differ from eager")
            if captured.disabled_reason is not None:
                problems.append(f"{label}: the capture turned off: {captured.disabled_reason}")
            if captured.captured_steps != self.new_tokens - 1:
                problems.append(f"{label}: {captured.captured_steps} of {self.new_tokens - 1} decode steps captured")
        details["cudagraph_skips"] = self._cudagraph_skips() - skips_before
        if self.device == "cuda" and details["cudagraph_skips"]:
            problems.append(f"inductor skipped CUDA graphs {details['cudagraph_skips']} times (see the log)")
        details["tokens_equal"] = all(details[label]["tokens_equal"] for label in ("four", "three_padded"))
        return judged(problems, **details)

    def speed(self, arch: str) -> Outcome:
        dtype = "float32" if self.mode.dry_run else "bfloat16"
        prompts = PROMPTS[:4]
        eager = self.generate(arch, dtype, prompts, SPEED_NEW_TOKENS, captured=False)
        captured = self.generate(arch, dtype, prompts, SPEED_NEW_TOKENS, captured=True)
        return passed(arch=arch, device=self.device, dtype=dtype, sequences=len(prompts),
                      new_tokens=SPEED_NEW_TOKENS, eager_ms_per_token=eager.ms_per_token,
                      captured_ms_per_token=captured.ms_per_token,
                      speedup_vs_eager=eager.ms_per_token / captured.ms_per_token,
                      captured_steps=captured.captured_steps, disabled_reason=captured.disabled_reason)

    def _synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    @staticmethod
    def _cudagraph_skips() -> int:
        return int(counters["inductor"]["cudagraph_skips"])


def build_part(mode: RunMode) -> CapturedPart:
    return CapturedPart(mode)
