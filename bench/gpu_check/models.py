"""gpu_check parts that run the runtime in this process against a reference, one model at a time.

  parity     LLM(..., device=<the run's device>) against transformers on every tiny architecture
  offline    offline generation, this runtime vs transformers `generate`, on the run's device
  captured   the captured decode step (`enable_torch_compile`) replayed as CUDA graphs, against eager

Each part's class says what its checks hold it to.
"""
from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from bench import bench_offline as offline
from engine_helpers import PROMPTS, greedy, runtime_prefill_logits
from moe_runtime import LLM, SamplingParams
from test_engine_parity import ARCHS as PARITY_ARCHS
from test_engine_parity import NEW_TOKENS as PARITY_NEW_TOKENS
from tiny_checkpoints import HFOracle, TinyCheckpointFactory

from .kernel_shapes import synchronize
from .report import Outcome, RunMode, judged, passed, skipped
from .tiny_models import tiny_factory


# ---------------------------------------------------------------------------------------------- parity

FP32_LOGITS_TOLERANCE = 1e-4          # tests/test_engine_parity.py's
BF16_MEDIAN_ERROR_FACTOR = 2.0
BF16_MEDIAN_ERROR_FLOOR = 0.02
BF16_ARGMAX_SLACK = 0.10
# MLA + grouped sigmoid routing + shared experts + a dense first layer; GQA + softmax routing. DeepSeek
# first: it is the last of PARITY_ARCHS, so its oracle is still at hand.
EP2_ARCHS = ("deepseek_v3", "qwen3_moe")
# The dry run rehearses this part's code, not every model (the GPU run does all ten): a dense model
# and a MoE, ep=2 on the MoE, fewer new tokens (transformers on 2 CPU cores is slow; tokens stay exact).
PARITY_DRY_RUN_ARCHS = ("llama", "qwen3_moe")
DRY_RUN_EP2_ARCHS = ("qwen3_moe",)
PARITY_DRY_RUN_NEW_TOKENS = 8
PARITY_TINY_ARCHS = ("qwen3_moe",)
PARITY_TINY_NEW_TOKENS = 4


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
    """Part `parity`: LLM(..., device=<the run's device>) against transformers on every tiny architecture.

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

    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = mode.device
        self.archs = list(PARITY_TINY_ARCHS if mode.tiny else PARITY_DRY_RUN_ARCHS if mode.dry_run else PARITY_ARCHS)
        self.prompts = PROMPTS[:2] if mode.tiny else PROMPTS
        self.new_tokens = (PARITY_TINY_NEW_TOKENS if mode.tiny else PARITY_DRY_RUN_NEW_TOKENS if mode.dry_run
                           else PARITY_NEW_TOKENS)
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
                self._factory = tiny_factory(self.mode.work_dir)
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


# --------------------------------------------------------------------------------------------- offline

FP8 = "fp8"                  # a row name: bf16 compute, weights kept in FP8 (--quantization fp8)
FP8_COMPUTE_DTYPE = "bfloat16"


class OfflinePart:
    """Part `offline`: offline generation, this runtime vs transformers `generate`, on the run's device.

    bench/bench_offline.py runs on the CPU only (its runners hard-code device="cpu" and it always writes
    bench/results/offline_generate.json), so this part reuses its pieces instead of its main: the same
    cached Qwen3-MoE checkpoint (`build_checkpoint`), prompts (`make_prompts`), prompt length and the
    weight-bytes model, with both systems on the run's device in this one process, one after the
    other. Reported per dtype and batch: tokens/s of each, the ratio, identical sequences, and the
    weight bandwidth each reached. Speed is never gated; a system that fails to produce its tokens is.
    The `fp8` rows run the bf16 checkpoint with `--quantization fp8` (weights quantized at load, the
    Triton FP8 grouped GEMM on the GPU) against transformers in bf16: their tokens may rightly differ.
    """

    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = mode.device
        if mode.dry_run or mode.tiny:
            # On the CPU a 64-token prefill of this 110M-parameter model takes seconds: the rehearsal
            # cuts the prompts to 16 tokens and generates 4.
            self.dtypes, self.batches, self.new_tokens, self.repeats = ("float32",), (1,), 4, 1
            self.prompt_len = 16
        else:
            self.dtypes, self.batches, self.new_tokens, self.repeats = ("bfloat16", FP8), (1, 16), offline.NEW_TOKENS, 2
            self.prompt_len = offline.PROMPT_LEN
        self._systems: dict = {}           # dtype -> (LLM, transformers model): built once per dtype

    def check_names(self) -> list[str]:
        return [f"generate/{dtype}/batch{batch}" for dtype in self.dtypes for batch in self.batches]

    def close(self) -> None:
        for llm, _ in self._systems.values():
            llm.shutdown()
        self._systems.clear()

    def _built(self, dtype: str):
        if dtype not in self._systems:
            self.close()
            from transformers import AutoModelForCausalLM

            compute = FP8_COMPUTE_DTYPE if dtype == FP8 else dtype
            path = offline.build_checkpoint(compute)
            if not any(path.glob("*.safetensors")):       # a build cut short left config.json only
                shutil.rmtree(path)
                path = offline.build_checkpoint(compute)
            path = str(path)
            llm = LLM(path, device=self.device, dtype=compute, max_num_seqs=max(self.batches),
                      quantization=FP8 if dtype == FP8 else None)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, compute), local_files_only=True)
            self._systems[dtype] = (llm, model.to(self.device).eval())
        return self._systems[dtype]

    def run(self, name: str) -> Outcome:
        _, dtype, batch = name.split("/")
        batch = int(batch.removeprefix("batch"))
        llm, model = self._built(dtype)
        prompts = [prompt[:self.prompt_len] for prompt in offline.make_prompts(batch)]
        runtime_s, runtime_tokens = self._time_runtime(llm, prompts)
        hf_s, hf_tokens = self._time_transformers(model, prompts)
        generated = batch * self.new_tokens
        element = torch.tensor([], dtype=getattr(torch, FP8_COMPUTE_DTYPE if dtype == FP8 else dtype)).element_size()
        step_bytes = offline.weight_bytes_per_decode_step(
            batch, element, offline.FP8_BYTES_PER_WEIGHT if dtype == FP8 else None)
        core = getattr(llm.engine, "core", None)
        problems = [f"{system} produced {[len(t) for t in tokens]} tokens, wanted {self.new_tokens} each"
                    for system, tokens in (("runtime", runtime_tokens), ("transformers", hf_tokens))
                    if any(len(t) != self.new_tokens for t in tokens)]
        return judged(problems, device=self.device, dtype=dtype, batch=batch, prompt_len=self.prompt_len,
                      new_tokens=self.new_tokens, repeats=self.repeats, runtime_tok_s=generated / runtime_s,
                      transformers_tok_s=generated / hf_s, speedup_vs_transformers=hf_s / runtime_s,
                      identical_sequences=f"{sum(a == b for a, b in zip(runtime_tokens, hf_tokens))}/{batch}",
                      runtime_weight_gbs=step_bytes * self.new_tokens / runtime_s / 1e9,
                      transformers_weight_gbs=step_bytes * self.new_tokens / hf_s / 1e9,
                      kernels=core.kernels.name if core is not None else None,
                      shape=offline.SHAPE)

    def _time_runtime(self, llm: LLM, prompts) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=self.new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))   # warm-up
        best, outputs = float("inf"), []
        for _ in range(self.repeats):
            synchronize(self.device)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            synchronize(self.device)
            best = min(best, time.perf_counter() - started)
        return best, [o.token_ids for o in outputs]

    def _time_transformers(self, model, prompts) -> tuple[float, list[list[int]]]:
        input_ids = torch.tensor(prompts, device=self.device)
        kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(input_ids))
        best, out = float("inf"), None
        with torch.no_grad():
            model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, **kwargs)                  # warm-up
            for _ in range(self.repeats):
                synchronize(self.device)
                started = time.perf_counter()
                out = model.generate(input_ids, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                     **kwargs)
                synchronize(self.device)
                best = min(best, time.perf_counter() - started)
        return best, out[:, input_ids.shape[1]:].tolist()


# -------------------------------------------------------------------------------------------- captured

CAPTURED_ARCHS = ("qwen3_moe", "deepseek_v3")   # GQA + routed experts; MLA + shared experts + a dense first layer
CAPTURED_DRY_RUN_ARCHS = ("qwen3_moe",)
CAPTURED_NEW_TOKENS = 16
CAPTURED_TINY_NEW_TOKENS = 4
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
    """Part `captured`: the captured decode step (`enable_torch_compile`) replayed as CUDA graphs.

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

    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = mode.device
        self.archs = list(CAPTURED_DRY_RUN_ARCHS if mode.dry_run or mode.tiny else CAPTURED_ARCHS)
        self.new_tokens = CAPTURED_TINY_NEW_TOKENS if mode.tiny else CAPTURED_NEW_TOKENS
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
            self._factory = tiny_factory(self.mode.work_dir)
        return self._factory(arch)

    def generate(self, arch: str, dtype: str, prompts: list[list[int]], new_tokens: int, captured: bool) -> EngineRun:
        options = dict(enable_torch_compile=True, torch_compile_max_bs=MAX_BATCH,
                       torch_compile_backend=self.backend) if captured else {}
        with LLM(str(self.checkpoint(arch)), device=self.device, dtype=dtype, **options) as llm:
            llm.generate(prompts, greedy(2))                      # compiles (or warms) the bucket, not timed
            capture = llm.core.runner.capture
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

