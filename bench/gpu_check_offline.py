"""gpu_check part `offline`: offline generation, this runtime vs transformers `generate`, on the run's device.

bench/bench_offline.py runs on the CPU only (its runners hard-code device="cpu" and it always writes
bench/results/offline_generate.json), so this part reuses its pieces instead of its main: the same
cached Qwen3-MoE checkpoint (`build_checkpoint`), prompts (`make_prompts`), prompt length and the
weight-bytes model, with both systems on the run's device in this one process, one after the
other. Reported per dtype and batch: tokens/s of each, the ratio, identical sequences, and the
weight bandwidth each reached. Speed is never gated; a system that fails to produce its tokens is.
The `fp8` rows run the bf16 checkpoint with `--quantization fp8` (weights quantized at load, the
Triton FP8 grouped GEMM on the GPU) against transformers in bf16: their tokens may rightly differ.
"""
from __future__ import annotations

import shutil
import time

import torch

import bench_offline as offline
from gpu_check_mode import RunMode
from gpu_check_outcome import Outcome, judged
from gpu_check_timing import synchronize
from moe_runtime import LLM, SamplingParams

FP8 = "fp8"                  # a row name: bf16 compute, weights kept in FP8 (--quantization fp8)
FP8_COMPUTE_DTYPE = "bfloat16"


class OfflinePart:
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


def build_part(mode: RunMode) -> OfflinePart:
    return OfflinePart(mode)
