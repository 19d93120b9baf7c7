"""FlashInfer (`flashinfer-python`) behind the attention seam: paged prefill, decode and MLA, the kernels
SGLang and vLLM serve with, used on CUDA when the package imports and the shapes are ones it compiles for.

**Not yet run on a GPU.** Written against FlashInfer's documented wrappers (docs.flashinfer.ai, `plan`
then `run`): `BatchPrefillWithPagedKVCacheWrapper`, `BatchDecodeWithPagedKVCacheWrapper` (layout "NHD":
our cache blocks are [pages, page_size, kv_heads, dim], K and V passed as a tuple) and
`BatchMLAPagedAttentionWrapper` (absorbed MLA: the latent and rope parts of our one-head latent cache
passed as two strided views, as SGLang passes its buffer). What the CPU tests check is the translation of
our block tables into FlashInfer's page table (`FlashInferPageTable`) and the plan / run calls a fake
wrapper records; whether FlashInfer accepts the strided MLA views and our page sizes, and its numbers,
is for the first GPU run (bench/gpu_check part `attention`).

Page table: FlashInfer's CSR form, indptr [B + 1] (page offsets), indices [pages in use] (physical
pages, sequence by sequence) and last_page_len [B] (tokens in each sequence's last page, 1..page_size;
0 for an empty sequence), plus kv_len [B] for MLA. A plan is made once per step and wrapper shape and
reused by every layer with that shape (same block-table tensors: checked by identity). FlashInfer's plan
reads the page table on the host, so this backend serves eager steps only: under torch.compile (a
captured decode) the seam takes the Triton kernel.

Spans and sinks: a sliding window runs as the prefill plan's `window_left` (W - 1: keys i - W + 1 .. i).
Chunked spans, attention sinks (the general wrappers take none: only FlashInfer's TRT-LLM-generated kernels
do, on some GPUs) and decode rows with a first key of their own (`key_starts`) are not taken: `supports`
says no and the seam runs the Triton kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from .key_span import KeySpan, is_windowed
from .paged_prefill_attention import PagedPrefillBatch

WORKSPACE_BYTES = 128 * 1024 * 1024     # FlashInfer's recommended float workspace (split-k partials)
MLA_LATENT, MLA_ROPE = 512, 64          # the one MLA head shape FlashInfer's MLA kernels are built for
GQA_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class FlashInferPageTable:
    indptr: torch.Tensor          # [B + 1] int32: sequence b's pages are indices[indptr[b]:indptr[b + 1]]
    indices: torch.Tensor         # [sum of pages] int32: physical cache blocks
    last_page_len: torch.Tensor   # [B] int32: tokens in the last page (0: no page)
    kv_len: torch.Tensor          # [B] int32: tokens of context


def page_table(block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int) -> FlashInferPageTable:
    """Our [B, max_blocks] (-1 padded) block tables and [B] context lengths in FlashInfer's CSR form."""
    lens = context_lens.to(torch.int32)
    pages = (lens + page_size - 1) // page_size                                        # [B]
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(block_tables.shape[1], device=lens.device)[None, :] < pages[:, None]   # [B, W]
    indices = block_tables[used].to(torch.int32)                                       # row-major: by sequence
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    return FlashInferPageTable(indptr, indices, last, lens)


def is_mla_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Values a prefix view of one-head keys: the absorbed MLA latent cache."""
    return (k_cache.shape[2] == 1 and v_cache.data_ptr() == k_cache.data_ptr()
            and v_cache.stride() == k_cache.stride())


def shapes_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """fp16 / bf16 throughout; GQA with a head dim FlashInfer compiles (keys and values alike); MLA 512 + 64."""
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    if is_mla_cache(k_cache, v_cache):
        return v_cache.shape[3] == MLA_LATENT and k_cache.shape[3] == MLA_LATENT + MLA_ROPE
    return k_cache.shape[3] == v_cache.shape[3] == q.shape[2] and q.shape[2] in GQA_HEAD_DIMS


class FlashInferWrappers(Protocol):
    """Builds FlashInfer's wrappers (the real module, or a fake in tests)."""

    def prefill(self, workspace: torch.Tensor) -> Any: ...
    def decode(self, workspace: torch.Tensor, use_tensor_cores: bool) -> Any: ...
    def mla(self, workspace: torch.Tensor) -> Any: ...


@dataclass(frozen=True)
class FlashInferModule:
    """The installed flashinfer package's wrappers."""

    module: Any

    def prefill(self, workspace):
        return self.module.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def decode(self, workspace, use_tensor_cores: bool):
        return self.module.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)

    def mla(self, workspace):
        return self.module.mla.BatchMLAPagedAttentionWrapper(workspace)


def import_flashinfer() -> FlashInferModule | None:
    """The one place flashinfer is imported (an optional GPU dependency: `pip install moe-runtime[gpu]`)."""
    try:
        import flashinfer
    except Exception:   # noqa: BLE001 - not installed, or built for another torch / CUDA: the Triton kernels serve
        return None
    return FlashInferModule(flashinfer)


@dataclass
class _Planned:
    wrapper: Any
    inputs: tuple = ()    # the tensors the last plan was made for (identity: one plan per step and shape)


@dataclass
class FlashInferAttention:
    """Decode and varlen prefill over our paged cache through FlashInfer; `supports` says when it applies."""

    wrappers: FlashInferWrappers
    device: torch.device
    _workspace: torch.Tensor | None = None
    _planned: dict = field(default_factory=dict)   # plan key -> _Planned

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: KeySpan | None = None,
                 sinks: torch.Tensor | None = None) -> bool:
        """On CUDA, eager (FlashInfer plans on the host: not inside a captured step), shapes it is built for,
        full attention or a sliding window (not on MLA), no sinks."""
        if sinks is not None or (is_windowed(span) and (span.code != 1 or is_mla_cache(k_cache, v_cache))):
            return False
        return q.device.type == "cuda" and not torch.compiler.is_compiling() and shapes_supported(q, k_cache, v_cache)

    def _wrapper(self, key: tuple, build: Callable[[torch.Tensor], Any], inputs: tuple,
                 plan: Callable[[Any], None]) -> Any:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        planned = self._planned.get(key)
        if planned is None:
            planned = self._planned[key] = _Planned(build(self._workspace))
        if len(planned.inputs) != len(inputs) or any(a is not b for a, b in zip(planned.inputs, inputs)):
            plan(planned.wrapper)
            planned.inputs = inputs
        return planned.wrapper

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale: float, key_starts=None,
               sinks=None) -> torch.Tensor:
        if key_starts is not None or sinks is not None:
            raise ValueError("FlashInfer's decode is not given rows' first keys or sinks here: use the Triton kernel")
        page_size = k_cache.shape[1]
        if is_mla_cache(k_cache, v_cache):
            qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
            return self._mla(q, k_cache, qo_indptr, block_tables, context_lens, scale, causal=False)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // num_kv_heads
        key = ("decode", q.shape[1], num_kv_heads, head_dim, page_size, q.dtype, scale)

        def plan(wrapper):
            table = page_table(block_tables, context_lens, page_size)
            wrapper.plan(table.indptr, table.indices, table.last_page_len, q.shape[1], num_kv_heads, head_dim,
                         page_size, q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)

        wrapper = self._wrapper(key, lambda ws: self.wrappers.decode(ws, use_tensor_cores=group >= 4),
                                (block_tables, context_lens), plan)
        return wrapper.run(q, (k_cache, v_cache))

    def prefill(self, q, k_cache, v_cache, batch: PagedPrefillBatch, scale: float, span: KeySpan | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None or (is_windowed(span) and span.code != 1):
            raise ValueError("FlashInfer's prefill wrapper takes neither sinks nor chunked spans here")
        sliding_window = span.size if is_windowed(span) else None
        page_size = k_cache.shape[1]
        if is_mla_cache(k_cache, v_cache):
            if sliding_window is not None:
                raise ValueError("FlashInfer's MLA wrapper has no sliding window")
            return self._mla(q, k_cache, batch.cu_seqlens_q, batch.block_tables, batch.context_lens, scale,
                             causal=True)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        window_left = -1 if sliding_window is None else sliding_window - 1   # keys (i - window_left) .. i
        key = ("prefill", q.shape[1], num_kv_heads, head_dim, page_size, q.dtype, scale, window_left)

        def plan(wrapper):
            table = page_table(batch.block_tables, batch.context_lens, page_size)
            wrapper.plan(batch.cu_seqlens_q, table.indptr, table.indices, table.last_page_len, q.shape[1],
                         num_kv_heads, head_dim, page_size, causal=True, sm_scale=scale, window_left=window_left,
                         q_data_type=q.dtype, kv_data_type=k_cache.dtype)

        wrapper = self._wrapper(key, self.wrappers.prefill, (batch.cu_seqlens_q, batch.block_tables), plan)
        return wrapper.run(q, (k_cache, v_cache))

    def _mla(self, q, k_cache, qo_indptr, block_tables, context_lens, scale: float, causal: bool) -> torch.Tensor:
        """Absorbed MLA: q [T, h, 512 + 64] over the latent cache [pages, page_size, 1, 512 + 64]."""
        page_size = k_cache.shape[1]
        key = ("mla", causal, q.shape[1], page_size, q.dtype, scale)

        def plan(wrapper):
            table = page_table(block_tables, context_lens, page_size)
            wrapper.plan(qo_indptr, table.indptr, table.indices, table.kv_len, q.shape[1], MLA_LATENT, MLA_ROPE,
                         page_size, causal, scale, q.dtype, k_cache.dtype)

        wrapper = self._wrapper(key, self.wrappers.mla, (qo_indptr if causal else None, block_tables, context_lens),
                                plan)
        latent = k_cache[:, :, 0]                                                       # [pages, page_size, 576]
        q_nope, q_pe = q[..., :MLA_LATENT], q[..., MLA_LATENT:]
        return wrapper.run(q_nope, q_pe, latent[..., :MLA_LATENT], latent[..., MLA_LATENT:])
