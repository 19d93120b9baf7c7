"""Which kernels serve attention over the paged cache: decode (one new token per sequence) and varlen
prefill (all of a step's chunks in one launch), chosen once per kernel family and device.

- **FlashInfer** on CUDA when `flashinfer` imports (`pip install moe-runtime[gpu]`) and the Triton family
  runs: for fp16 / bf16 with head dims it is built for (GQA 64/128/256; MLA 512 + 64), eager steps only;
  any other call takes the Triton kernels below. Not yet run on a GPU (moe_runtime/kernels/flashinfer_attention.py).
- **Triton** (the family `get_kernels` picks on CUDA, or in the interpreter for tests): the split-context
  decode kernel and the varlen prefill kernel (moe_runtime/kernels/triton_impl/).
- **torch** (CPU, and the fallback): the family's paged decode kernel and `prefill=None`, which sends
  prefills through the per-sequence path in attention_ops.py (the CPU flash kernel, a loop per sequence).

DeepSeek Sparse Attention's indexer scores (`index_scores`) and its rows over their chosen tokens
(`sparse_latent`) run Triton kernels on the Triton and FlashInfer paths, their torch twins on the torch path.

Every family takes the same attention variants: decode rows' first keys (`key_starts`, a sliding window's or
a chunk's), a varlen span (full, sliding, chunked) and per-head sinks (gpt-oss). FlashInfer takes sliding
prefills only; anything else it does not support goes to Triton.

`MOE_ATTENTION_BACKEND` (flashinfer / triton / torch) overrides "auto" for comparisons on a GPU.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from moe_runtime.kernels.batch_invariant import BATCH_INVARIANT, invariant_prefill_attention
from moe_runtime.kernels.flashinfer_attention import FlashInferAttention, import_flashinfer
from moe_runtime.kernels.index_scores import index_scores as torch_index_scores
from moe_runtime.kernels.kernel_set_type import KernelSet
from moe_runtime.kernels.sparse_latent_attention import sparse_latent_attention as torch_sparse_latent_attention

logger = logging.getLogger(__name__)
BACKEND_ENV = "MOE_ATTENTION_BACKEND"
BACKENDS = ("flashinfer", "triton", "torch")

# (q [S, Hq, D], k_cache, v_cache, block_tables [S, W], context_lens [S], scale, key_starts=[S] | None,
#  sinks=[Hq] | None) -> [S, Hq, Dv]
DecodeAttention = Callable[..., torch.Tensor]
# (q [T, Hq, D], k_cache, v_cache, PagedPrefillBatch, scale, span=KeySpan | None, sinks=[Hq] | None) -> [T, Hq, Dv]
PrefillAttention = Callable[..., torch.Tensor]
# (q [T, H, D], entries [N, D], slots [T, K] (-1: none), scale, value_dim) -> [T, H, value_dim]
SparseLatentAttention = Callable[..., torch.Tensor]
# (queries [n, H, D], weights [n, H], keys [S, D] | [n, S, D], scale) -> [n, S] fp32
IndexScores = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class AttentionKernels:
    name: str
    decode: DecodeAttention
    prefill: PrefillAttention | None      # None: the torch per-sequence path (attention_ops.varlen_causal_attention)
    sparse_latent: SparseLatentAttention = torch_sparse_latent_attention   # each row over its chosen entries (DSA)
    index_scores: IndexScores = torch_index_scores                          # the DSA indexer's scores


@dataclass(frozen=True)
class FlashInferFirst:
    """FlashInfer where it `supports` the call, else the Triton kernel with the same signature."""

    flashinfer: FlashInferAttention
    triton_decode: DecodeAttention
    triton_prefill: PrefillAttention

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, key_starts=None, sinks=None):
        if key_starts is None and self.flashinfer.supports(q, k_cache, v_cache, sinks=sinks):
            return self.flashinfer.decode(q, k_cache, v_cache, block_tables, context_lens, scale)
        return self.triton_decode(q, k_cache, v_cache, block_tables, context_lens, scale, key_starts=key_starts,
                                  sinks=sinks)

    def prefill(self, q, k_cache, v_cache, batch, scale, span=None, sinks=None):
        if self.flashinfer.supports(q, k_cache, v_cache, span, sinks):
            return self.flashinfer.prefill(q, k_cache, v_cache, batch, scale, span)
        return self.triton_prefill(q, k_cache, v_cache, batch, scale, span, sinks)


def triton_prefill_kernel() -> PrefillAttention:
    from moe_runtime.kernels.triton_impl.paged_prefill_attention import paged_prefill_attention   # imports triton: only here

    return paged_prefill_attention


def triton_sparse_kernels() -> tuple[SparseLatentAttention, IndexScores]:
    from moe_runtime.kernels.triton_impl.index_scores import index_scores                           # imports triton: only here
    from moe_runtime.kernels.triton_impl.sparse_latent_attention import sparse_latent_attention

    return sparse_latent_attention, index_scores


def _requested() -> str:
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS + ("auto",):
        raise ValueError(f"{BACKEND_ENV}={choice!r} is not one of {BACKENDS + ('auto',)}")
    return choice


@functools.lru_cache(maxsize=None)
def attention_kernels(kernels: KernelSet, device_type: str, device_index: int | None = None) -> AttentionKernels:
    """The attention kernels for a kernel family on a device (one instance per pair: FlashInfer's workspace
    and plans are shared by all layers)."""
    if kernels.name == BATCH_INVARIANT:   # --deterministic: prefill rows reduce in the decode kernel's fixed order
        return AttentionKernels(kernels.name, kernels.paged_decode_attention, invariant_prefill_attention)
    choice = _requested()
    torch_path = AttentionKernels("torch", kernels.paged_decode_attention, None)
    if choice == "torch" or kernels.name != "triton":
        return torch_path
    triton_path = AttentionKernels("triton", kernels.paged_decode_attention, triton_prefill_kernel(),
                                   *triton_sparse_kernels())
    if choice == "triton" or device_type != "cuda":
        return triton_path
    module = import_flashinfer()
    if module is None:
        if choice == "flashinfer":
            raise RuntimeError(f"{BACKEND_ENV}=flashinfer but flashinfer does not import (pip install moe-runtime[gpu])")
        return triton_path
    device = torch.device(device_type, device_index)
    first = FlashInferFirst(FlashInferAttention(module, device), triton_path.decode, triton_path.prefill)
    logger.info("attention: FlashInfer on %s where it supports the shapes, Triton otherwise", device)
    return AttentionKernels("flashinfer", first.decode, first.prefill, triton_path.sparse_latent,
                            triton_path.index_scores)


def attention_kernels_for(kernels: KernelSet, device: torch.device) -> AttentionKernels:
    return attention_kernels(kernels, device.type, device.index)
