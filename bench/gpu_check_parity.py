"""gpu_check part `parity`: LLM(..., device=<the run's device>) against transformers on every tiny architecture.

The oracle is tests/test_engine_parity.py's: each tiny checkpoint (tests/tiny_checkpoints.py),
transformers in fp32 on the CPU, greedy, one prompt at a time (`HFOracle`), over tests/engine_helpers'
prompts. Per architecture:

  fp32_tokens/<arch>   the runtime in fp32: greedy tokens equal the oracle's (exact), and its prefill
                       logits are within the test's 1e-4.
  bf16_close/<arch>    the runtime in bf16, and transformers in bf16 on the same device, both held
                       against the fp32 oracle's logits at every prompt position. "Close" means:
                       (a) the median over positions of the largest |logit error| is at most twice
                           transformers' own bf16 median plus 0.02, and
                       (b) the argmax agrees with the fp32 oracle at no fewer positions than
                           transformers' bf16 argmax does, minus 10 points.
                       Medians and argmax rates, not maxima: a near-tie in routing flips an expert at
                       some position in any bf16 implementation (seen on CPU: transformers' own bf16
                       logits differ by up to 1.5 there). First-token agreement and the greedy
                       common prefix are reported, not gated (greedy sequences diverge after a flip).
  ep2_fp32_tokens/<arch>  ep=2 (two ranks, one GPU each) in fp32 gives the oracle's tokens; skipped
                       with the reason when fewer than two GPUs are visible. The dry run runs it on
                       CPU over gloo.

The dry run takes two architectures (llama, qwen3_moe) and 8 new tokens; --tiny one and 4.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_helpers import PROMPTS, greedy, runtime_prefill_logits
from gpu_check_mode import RunMode
from gpu_check_outcome import Outcome, judged, skipped
from moe_runtime import LLM
from moe_runtime.demo.tokenizer_training import save_tokenizer
from test_engine_parity import ARCHS, NEW_TOKENS
from tiny_checkpoints import HFOracle, TinyCheckpointFactory, tiny_tokenizer

FP32_LOGITS_TOLERANCE = 1e-4          # tests/test_engine_parity.py's
BF16_MEDIAN_ERROR_FACTOR = 2.0
BF16_MEDIAN_ERROR_FLOOR = 0.02
BF16_ARGMAX_SLACK = 0.10
# MLA + grouped sigmoid routing + shared experts + a dense first layer; GQA + softmax routing. DeepSeek
# first: it is the last of ARCHS, so its oracle is still at hand.
EP2_ARCHS = ("deepseek_v3", "qwen3_moe")
# The dry run rehearses this part's code, not every model (the GPU run does all ten): a dense model
# and a MoE, ep=2 on the MoE, fewer new tokens (transformers on 2 CPU cores is slow; tokens stay exact).
DRY_RUN_ARCHS = ("llama", "qwen3_moe")
DRY_RUN_EP2_ARCHS = ("qwen3_moe",)
DRY_RUN_NEW_TOKENS = 8
TINY_ARCHS = ("qwen3_moe",)
TINY_NEW_TOKENS = 4


@dataclass
class ArchOracle:
    """transformers' fp32 answers for one tiny checkpoint (computed once, used by every check of it)."""

    arch: str
    path: Path
    tokens: list[list[int]]            # greedy continuation of each prompt
    logits: list[torch.Tensor]         # [T, V] fp32 at every position of each prompt (CPU)


def first_divergence(got: list[int], want: list[int]) -> int:
    """How many leading tokens agree."""
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return index
    return min(len(got), len(want))


def position_errors(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    """Largest |logit error| at every position of every prompt."""
    return [float(err) for got, want in zip(logits, reference) for err in (got.float().cpu() - want).abs().amax(-1)]


def argmax_agreement(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    same = [bool(s) for got, want in zip(logits, reference) for s in got.float().cpu().argmax(-1) == want.argmax(-1)]
    return sum(same) / len(same)


class ParityPart:
    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = mode.device
        self.archs = list(TINY_ARCHS if mode.tiny else DRY_RUN_ARCHS if mode.dry_run else ARCHS)
        self.prompts = PROMPTS[:2] if mode.tiny else PROMPTS
        self.new_tokens = TINY_NEW_TOKENS if mode.tiny else DRY_RUN_NEW_TOKENS if mode.dry_run else NEW_TOKENS
        self.ep2_archs = [] if mode.tiny else list(DRY_RUN_EP2_ARCHS if mode.dry_run else EP2_ARCHS)
        self._factory: TinyCheckpointFactory | None = None
        self._oracle: ArchOracle | None = None

    def check_names(self) -> list[str]:
        names = [f"{kind}/{arch}" for arch in self.archs for kind in ("fp32_tokens", "bf16_close")]
        return names + [f"ep2_fp32_tokens/{arch}" for arch in self.ep2_archs]

    def run(self, name: str) -> Outcome:
        kind, arch = name.split("/")
        return {"fp32_tokens": self.fp32_tokens, "bf16_close": self.bf16_close,
                "ep2_fp32_tokens": self.ep2_fp32_tokens}[kind](arch)

    def close(self) -> None:
        self._oracle = None

    # ------------------------------------------------------------------------------------ oracle

    def oracle(self, arch: str) -> ArchOracle:
        if self._oracle is None or self._oracle.arch != arch:
            if self._factory is None:
                work = Path(self.mode.work_dir)
                tokenizer_dir = save_tokenizer(tiny_tokenizer(), work / "tiny_tokenizer")
                self._factory = TinyCheckpointFactory(work / "tiny_checkpoints", tokenizer_dir)
            path = self._factory(arch)
            hf = HFOracle(path)
            self._oracle = ArchOracle(arch, path, hf.greedy(self.prompts, self.new_tokens),
                                      [hf.prefill_logits(prompt) for prompt in self.prompts])
        return self._oracle

    def _runtime(self, oracle: ArchOracle, dtype: str, **layout):
        """Greedy tokens, prefill logits of every prompt (one rank only) and the kernel family used."""
        with LLM(str(oracle.path), device=self.device, dtype=dtype, **layout) as llm:
            tokens = [o.token_ids for o in llm.generate(self.prompts, greedy(self.new_tokens))]
            core = getattr(llm.engine, "core", None)
            if core is None:
                return tokens, None, "per rank"
            logits = [runtime_prefill_logits(core, prompt) for prompt in self.prompts]
            return tokens, logits, core.kernels.name

    def _token_details(self, tokens: list[list[int]], oracle: ArchOracle) -> dict:
        return {"tokens_equal": tokens == oracle.tokens,
                "prompts_equal": f"{sum(a == b for a, b in zip(tokens, oracle.tokens))}/{len(tokens)}",
                "common_prefix": [first_divergence(a, b) for a, b in zip(tokens, oracle.tokens)],
                "new_tokens": self.new_tokens}

    # ------------------------------------------------------------------------------------ checks

    def fp32_tokens(self, arch: str) -> Outcome:
        oracle = self.oracle(arch)
        tokens, logits, kernels = self._runtime(oracle, "float32")
        details = self._token_details(tokens, oracle)
        problems = [] if details["tokens_equal"] else [f"greedy tokens differ from transformers' "
                                                      f"(common prefix per prompt {details['common_prefix']})"]
        max_err = max(position_errors(logits, oracle.logits))
        if max_err > FP32_LOGITS_TOLERANCE:
            problems.append(f"prefill logits differ by {max_err:.3g} > {FP32_LOGITS_TOLERANCE:g}")
        return judged(problems, arch=arch, device=self.device, kernels=kernels, max_abs_err=max_err,
                      tolerance=f"tokens equal; logits atol {FP32_LOGITS_TOLERANCE:g}", **details)

    def bf16_close(self, arch: str) -> Outcome:
        oracle = self.oracle(arch)
        hf_logits = self._transformers_bf16_logits(oracle.path)
        tokens, logits, kernels = self._runtime(oracle, "bfloat16")
        runtime_errors, hf_errors = position_errors(logits, oracle.logits), position_errors(hf_logits, oracle.logits)
        runtime_median, hf_median = statistics.median(runtime_errors), statistics.median(hf_errors)
        runtime_argmax, hf_argmax = argmax_agreement(logits, oracle.logits), argmax_agreement(hf_logits, oracle.logits)
        bound = BF16_MEDIAN_ERROR_FACTOR * hf_median + BF16_MEDIAN_ERROR_FLOOR
        problems = []
        if runtime_median > bound:
            problems.append(f"median |logit error| {runtime_median:.3g} > {bound:.3g} "
                            f"({BF16_MEDIAN_ERROR_FACTOR:g} x transformers' bf16 {hf_median:.3g} + "
                            f"{BF16_MEDIAN_ERROR_FLOOR:g})")
        if runtime_argmax < hf_argmax - BF16_ARGMAX_SLACK:
            problems.append(f"argmax agrees at {runtime_argmax:.0%} of positions, transformers' bf16 at "
                            f"{hf_argmax:.0%}")
        details = self._token_details(tokens, oracle)
        first = sum(a[:1] == b[:1] for a, b in zip(tokens, oracle.tokens)) / len(tokens)
        return judged(problems, arch=arch, device=self.device, kernels=kernels, positions=len(runtime_errors),
                      median_abs_err=runtime_median, transformers_bf16_median_abs_err=hf_median,
                      max_abs_err=max(runtime_errors), transformers_bf16_max_abs_err=max(hf_errors),
                      argmax_agreement=runtime_argmax, transformers_bf16_argmax_agreement=hf_argmax,
                      first_token_agreement=first,
                      tolerance=f"median <= {BF16_MEDIAN_ERROR_FACTOR:g} x transformers' + "
                                f"{BF16_MEDIAN_ERROR_FLOOR:g}; argmax >= transformers' - {BF16_ARGMAX_SLACK:.0%}",
                      **details)

    def ep2_fp32_tokens(self, arch: str) -> Outcome:
        visible = torch.cuda.device_count() if self.device == "cuda" else 0
        if self.device == "cuda" and visible < 2:
            return skipped(f"{visible} CUDA device visible: ep=2 runs one rank per GPU (moe_runtime/processes/worker.py maps "
                           "rank r to cuda:r % device_count) and NCCL refuses two ranks on one device",
                           cuda_devices=visible)
        oracle = self.oracle(arch)
        tokens, _, _ = self._runtime(oracle, "float32", ep=2)
        details = self._token_details(tokens, oracle)
        problems = [] if details["tokens_equal"] else [f"ep=2 tokens differ from transformers' "
                                                      f"(common prefix per prompt {details['common_prefix']})"]
        backend = "nccl + gloo control" if self.device == "cuda" else "gloo"
        return judged(problems, arch=arch, device=self.device, layout="ep=2", backend=backend, **details)

    def _transformers_bf16_logits(self, path: Path) -> list[torch.Tensor]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, local_files_only=True)
        model = model.to(self.device).eval()
        logits = []
        with torch.no_grad():
            for prompt in self.prompts:
                ids = torch.tensor([prompt], device=self.device)
                logits.append(model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float().cpu())
        del model
        return logits


def build_part(mode: RunMode) -> ParityPart:
    return ParityPart(mode)
