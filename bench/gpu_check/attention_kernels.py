"""gpu_check part `attention`: the attention kernels at DeepSeek-V3 (absorbed MLA) and Llama (GQA) shapes.

- `prefill/...`: the Triton varlen kernel (one launch for every chunk of a step, each over its cached
  context) against the torch twin (`kernels.paged_prefill_attention`, a loop of per-sequence SDPA) in fp32
  on the same rounded inputs; the twin's time beside the kernel's.
- `decode/...`: the split-context Triton decode kernel against the torch twin, and its time with the
  policy's split count beside one split (flash-decoding's gain at batch 1 MLA is the number to read).
- `flashinfer/...`: FlashInfer's paged prefill / decode / MLA wrappers through our adapter
  (moe_runtime/kernels/flashinfer_attention.py) against the same twins; skipped, with the reason, where flashinfer
  does not import. Nothing of FlashInfer has run before its first GPU run of this part.

On CPU (--dry-run) the same checks run on tiny shapes in the Triton interpreter, fp32 and fp16, untimed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.kernels.flashinfer_attention import FlashInferAttention, import_flashinfer, shapes_supported
from moe_runtime.kernels.paged_attention import paged_decode_attention as twin_decode
from moe_runtime.kernels.paged_prefill_attention import PagedPrefillBatch
from moe_runtime.kernels.paged_prefill_attention import paged_prefill_attention as twin_prefill

from .kernel_shapes import Tolerance, best_ms, compare
from .report import Outcome, RunMode, judged, skipped

# Attention outputs are softmax-weighted means of values: in bf16 the kernels round the probabilities to
# bf16 before the P @ V product (as FlashAttention does), the twin does not.
TOLERANCES = {"float32": Tolerance(1e-4, 1e-4), "float16": Tolerance(5e-3, 5e-3), "bfloat16": Tolerance(2e-2, 2e-2)}


@dataclass(frozen=True)
class AttentionCase:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    block_size: int
    query_lens: tuple[int, ...]      # prefill: new rows per sequence; decode: ignored (one each)
    context_lens: tuple[int, ...]
    mla: bool = False                # values are the first v_dim columns of the one-head latent cache
    scale_dim: int | None = None     # MLA's softmax scale comes from qk_head_dim 192, not the latent 576


GPU_CASES = (
    AttentionCase("llama_gqa_chunks", 32, 8, 128, 128, 16, (512, 1, 37, 300), (512, 2000, 37, 1300)),
    AttentionCase("deepseek_v3_mla_dp_chunks", 128, 1, 576, 512, 16, (256, 64), (256, 1024), mla=True, scale_dim=192),
    AttentionCase("deepseek_v3_mla_tp8_chunks", 16, 1, 576, 512, 16, (1024, 96), (1024, 4096), mla=True,
                  scale_dim=192),
)
GPU_DECODE_CASES = (
    AttentionCase("deepseek_v3_mla_dp_b1", 128, 1, 576, 512, 16, (), (4096,), mla=True, scale_dim=192),
    AttentionCase("deepseek_v3_mla_dp_b16", 128, 1, 576, 512, 16, (), (1, 100, 4000) * 5 + (2048,), mla=True,
                  scale_dim=192),
    AttentionCase("llama_gqa_b1", 32, 8, 128, 128, 16, (), (8192,)),
    AttentionCase("llama_gqa_b64", 32, 8, 128, 128, 16, (), tuple(range(17, 64 * 131, 131))),
)
DRY_CASES = (
    AttentionCase("gqa_chunks", 4, 2, 16, 16, 4, (5, 1, 7), (9, 1, 7)),
    AttentionCase("mla_like_chunks", 16, 1, 24, 16, 4, (3, 6), (20, 6), mla=True),
)
DRY_DECODE_CASES = (
    AttentionCase("mla_like_b1", 16, 1, 24, 16, 4, (), (37,), mla=True),
    AttentionCase("gqa_b3", 4, 2, 16, 16, 4, (), (1, 9, 17)),
)


class AttentionKernelsPart:
    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = torch.device(mode.device)
        self.dtypes = ("float32", "float16") if mode.dry_run else ("bfloat16",)
        self.timed = not mode.dry_run
        from moe_runtime.kernels.triton_impl import paged_attention, paged_prefill_attention   # triton: the part's child only

        self.triton_decode = paged_attention.paged_decode_attention
        self.triton_prefill = paged_prefill_attention.paged_prefill_attention
        prefill_cases = DRY_CASES if mode.dry_run else GPU_CASES
        decode_cases = DRY_DECODE_CASES if mode.dry_run else GPU_DECODE_CASES
        if mode.tiny:
            prefill_cases, decode_cases = prefill_cases[:1], decode_cases[:1]
        module = None if mode.dry_run else import_flashinfer()
        self.flashinfer = FlashInferAttention(module, self.device) if module is not None else None
        self._checks = {}
        for dtype in self.dtypes:
            for case in prefill_cases:
                self._checks[f"prefill/{case.name}/{dtype}"] = lambda c=case, d=dtype: self._prefill(c, d, False)
                self._checks[f"flashinfer/prefill/{case.name}/{dtype}"] = lambda c=case, d=dtype: self._prefill(c, d, True)
            for case in decode_cases:
                self._checks[f"decode/{case.name}/{dtype}"] = lambda c=case, d=dtype: self._decode(c, d, False)
                self._checks[f"flashinfer/decode/{case.name}/{dtype}"] = lambda c=case, d=dtype: self._decode(c, d, True)

    def check_names(self) -> list[str]:
        return list(self._checks)

    def run(self, name: str) -> Outcome:
        return self._checks[name]()

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------ inputs

    def _cache(self, case: AttentionCase, dtype: torch.dtype):
        generator = torch.Generator().manual_seed(len(case.name))
        needed = [(n + case.block_size - 1) // case.block_size for n in case.context_lens]
        num_blocks = sum(needed) + 2
        keys = torch.randn(num_blocks, case.block_size, case.kv_heads, case.head_dim, generator=generator)
        k_cache = keys.to(self.device, dtype)
        v_cache = k_cache[..., :case.v_dim] if case.mla else torch.randn(
            num_blocks, case.block_size, case.kv_heads, case.v_dim, generator=generator).to(self.device, dtype)
        free = torch.randperm(num_blocks, generator=generator).tolist()
        tables = torch.full((len(case.context_lens), max(needed) + 1), -1, dtype=torch.int32)
        for seq, need in enumerate(needed):
            tables[seq, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
        return k_cache, v_cache, tables.to(self.device), generator

    def _fp32(self, k_cache, v_cache, case: AttentionCase):
        k32 = k_cache.float()
        return k32, (k32[..., :case.v_dim] if case.mla else v_cache.float())

    def _judge(self, kind: str, dtype: str, got, want, **details) -> Outcome:
        tolerance = TOLERANCES[dtype]
        result = compare(got, want, tolerance)
        problems = [p for p in [result.problem(kind)] if p]
        return judged(problems, kernel=kind, dtype=dtype, tolerance=str(tolerance), max_abs_err=result.max_abs_err,
                      comparison=result.as_details(), **details)

    def _flashinfer_unavailable(self, q, k_cache, v_cache) -> str | None:
        if self.flashinfer is None:
            return "flashinfer does not import here (pip install moe-runtime[gpu] on a CUDA machine)"
        if not shapes_supported(q, k_cache, v_cache):
            return f"not a shape/dtype FlashInfer is built for ({q.dtype}, head dim {q.shape[-1]})"
        return None

    # ------------------------------------------------------------------------------------------ checks

    def _prefill(self, case: AttentionCase, dtype_name: str, flashinfer: bool) -> Outcome:
        dtype = getattr(torch, dtype_name)
        k_cache, v_cache, tables, generator = self._cache(case, dtype)
        batch = PagedPrefillBatch.build(list(case.query_lens), list(case.context_lens), tables, case.block_size)
        q = torch.randn(batch.num_tokens, case.q_heads, case.head_dim, generator=generator).to(self.device, dtype)
        scale = (case.scale_dim or case.head_dim) ** -0.5
        if flashinfer and (reason := self._flashinfer_unavailable(q, k_cache, v_cache)):
            return skipped(reason)
        run = (lambda: self.flashinfer.prefill(q, k_cache, v_cache, batch, scale)) if flashinfer else \
            (lambda: self.triton_prefill(q, k_cache, v_cache, batch, scale))
        k32, v32 = self._fp32(k_cache, v_cache, case)
        want = twin_prefill(q.float(), k32, v32, batch, scale)
        details = dict(query_lens=list(case.query_lens), context_lens=list(case.context_lens), q_heads=case.q_heads,
                       kv_heads=case.kv_heads, head_dim=case.head_dim, v_dim=case.v_dim, mla=case.mla)
        if self.timed:
            kernel_ms = best_ms(run, self.device)
            twin_ms = best_ms(lambda: twin_prefill(q, k_cache, v_cache, batch, scale), self.device)
            details.update(kernel_ms=kernel_ms, torch_twin_ms=twin_ms, speedup_vs_torch_twin=twin_ms / kernel_ms)
        return self._judge("flashinfer_prefill" if flashinfer else "paged_prefill_attention", dtype_name, run(), want,
                           **details)

    def _decode(self, case: AttentionCase, dtype_name: str, flashinfer: bool) -> Outcome:
        dtype = getattr(torch, dtype_name)
        k_cache, v_cache, tables, generator = self._cache(case, dtype)
        lens = torch.tensor(case.context_lens, dtype=torch.int32, device=self.device)
        q = torch.randn(len(case.context_lens), case.q_heads, case.head_dim, generator=generator).to(self.device, dtype)
        scale = (case.scale_dim or case.head_dim) ** -0.5
        if flashinfer and (reason := self._flashinfer_unavailable(q, k_cache, v_cache)):
            return skipped(reason)
        run = (lambda: self.flashinfer.decode(q, k_cache, v_cache, tables, lens, scale)) if flashinfer else \
            (lambda: self.triton_decode(q, k_cache, v_cache, tables, lens, scale))
        k32, v32 = self._fp32(k_cache, v_cache, case)
        want = twin_decode(q.float(), k32, v32, tables, lens, scale)
        details = dict(batch=len(case.context_lens), max_context=max(case.context_lens), q_heads=case.q_heads,
                       kv_heads=case.kv_heads, head_dim=case.head_dim, mla=case.mla)
        if self.timed:
            kernel_ms = best_ms(run, self.device)
            twin_ms = best_ms(lambda: twin_decode(q, k_cache, v_cache, tables, lens, scale), self.device)
            details.update(kernel_ms=kernel_ms, torch_twin_ms=twin_ms, speedup_vs_torch_twin=twin_ms / kernel_ms)
            if not flashinfer:
                one_ms = best_ms(lambda: self.triton_decode(q, k_cache, v_cache, tables, lens, scale, num_splits=1),
                                 self.device)
                details.update(one_split_ms=one_ms, speedup_vs_one_split=one_ms / kernel_ms)
        split_agreement = {}
        if not flashinfer:   # the split count must not change the answer beyond rounding
            split_agreement["one_split_max_abs_diff"] = float(
                (self.triton_decode(q, k_cache, v_cache, tables, lens, scale, num_splits=1).float()
                 - run().float()).abs().max())
        return self._judge("flashinfer_decode" if flashinfer else "paged_decode_attention", dtype_name, run(), want,
                           **details, **split_agreement)
