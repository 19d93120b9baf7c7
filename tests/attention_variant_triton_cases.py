"""The Triton attention kernels with the late-2026 variants (sinks, chunked spans, sliding windows through the
decode kernel, freed blocks pointing at a NaN scratch block) against the float64 oracle of
attention_variant_oracle.py, and the layers' seam through them. Run by test_attention_variants.py in a child
process with TRITON_INTERPRET=1 (fp32, fp16) on CPU; compiled (bf16, fp32) on CUDA.
"""
import os

import pytest
import torch

from attention_variant_oracle import CHUNK, DECODE_CASES, PREFILL_CASES, WINDOW, variant_case
from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.paged_prefill_attention import PagedPrefillBatch
from moe_runtime.layers.attention_backend import attention_kernels_for
from moe_runtime.layers.attention_ops import paged_varlen_attention, split_attention

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32, torch.float16]

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("attention_variant_triton_cases.py runs on CUDA or with TRITON_INTERPRET=1 set before triton "
                       "is imported")

from moe_runtime.kernels.triton_impl import paged_attention as triton_decode              # noqa: E402  (after the check)
from moe_runtime.kernels.triton_impl import paged_prefill_attention as triton_prefill     # noqa: E402


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}[dtype]


def on_device(case, dtype):
    return case.q.to(DEVICE, dtype), case.k_cache.to(DEVICE, dtype), case.v_cache.to(DEVICE, dtype)


@pytest.mark.parametrize("case_name", sorted(PREFILL_CASES))
def test_varlen_prefill_kernel_matches_float64(case_name):
    case = variant_case(*PREFILL_CASES[case_name])
    sinks = None if case.sinks is None else case.sinks.to(DEVICE)
    for dtype in DTYPES:
        q, k_cache, v_cache = on_device(case, dtype)
        batch = PagedPrefillBatch.build(case.query_lens, case.context_lens, case.tables.to(DEVICE), case.block_size)
        got = triton_prefill.paged_prefill_attention(q, k_cache, v_cache, batch, 0.25, case.span, sinks)
        assert got.dtype == dtype and not got.isnan().any()
        torch.testing.assert_close(got.double().cpu(), case.expected, **tolerance(dtype))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case_name", sorted(DECODE_CASES))
def test_decode_kernel_reads_each_row_from_its_first_key(case_name, splits):
    """One split (the output written directly) and three (merged by log-sum-exp, the sink in split 0 only)."""
    case = variant_case(*DECODE_CASES[case_name])
    starts = case.key_starts().to(DEVICE) if case.span.windowed else None
    sinks = None if case.sinks is None else case.sinks.to(DEVICE)
    lens = torch.tensor(case.context_lens, dtype=torch.int32, device=DEVICE)
    for dtype in DTYPES:
        q, k_cache, v_cache = on_device(case, dtype)
        got = triton_decode.paged_decode_attention(q, k_cache, v_cache, case.tables.to(DEVICE), lens, 0.25,
                                                   key_starts=starts, sinks=sinks, num_splits=splits)
        torch.testing.assert_close(got.double().cpu(), case.expected, **tolerance(dtype))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("span", [CHUNK, WINDOW], ids=["chunked", "sliding"])
def test_a_mixed_step_through_the_triton_seam(span, static):
    """Decodes past their chunk start or window in the decode kernel, the other rows in one varlen launch (a
    captured step: every row one token, first keys computed on the device)."""
    query_lens = [1, 1, 1] if static else [1, 9, 1, 14, 1]
    context_lens = [17, 9, 30] if static else [17, 25, 9, 14, 30]
    case = variant_case(query_lens, context_lens, span, True, seed=3)
    attention = attention_kernels_for(get_kernels(DEVICE, "triton"), torch.device(DEVICE))
    batch, sinks = case.batch(DEVICE), case.sinks.to(DEVICE)
    batch.static_decode = static
    q, k_cache, v_cache = on_device(case, torch.float32)

    def single(rows, tables, lens, key_starts=None):
        return attention.decode(q if rows is None else q[rows], k_cache, v_cache, tables, lens, 0.25,
                                key_starts=key_starts, sinks=sinks)

    def varlen(seqs):
        return paged_varlen_attention(q, batch, attention.prefill, k_cache, v_cache, 0.25, span, seqs, sinks=sinks)

    torch.testing.assert_close(split_attention(batch, span, single, varlen).double().cpu(), case.expected,
                               **tolerance(torch.float32))
