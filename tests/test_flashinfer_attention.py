"""The FlashInfer adapter on CPU: our block tables in FlashInfer's page table (indptr / indices / last_page_len),
and the plan / run calls it makes, recorded by fake wrappers that compute attention from what they were given
(so a wrong translation gives a wrong answer, not just a wrong record). FlashInfer itself needs a GPU: its
kernels are checked by bench/gpu_check's `attention` part."""
from dataclasses import dataclass, field

import torch

from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.flashinfer_attention import FlashInferAttention, is_mla_cache, page_table, shapes_supported
from moe_runtime.kernels.paged_prefill_attention import PagedPrefillBatch
from moe_runtime.kernels.paged_prefill_attention import paged_prefill_attention as torch_prefill
from moe_runtime.kernels.paged_attention import paged_decode_attention as torch_decode
from moe_runtime.layers.attention_backend import FlashInferFirst, attention_kernels_for


def test_page_table_is_flashinfer_csr():
    tables = torch.tensor([[7, 2, 9, -1], [4, -1, -1, -1], [-1, -1, -1, -1], [1, 3, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([9, 4, 0, 13], dtype=torch.int32)
    table = page_table(tables, lens, page_size=4)
    assert table.indptr.tolist() == [0, 3, 4, 4, 8]
    assert table.indices.tolist() == [7, 2, 9, 4, 1, 3, 5, 6]
    assert table.last_page_len.tolist() == [1, 4, 0, 1]       # 1..page_size; 0 for a sequence with no page
    assert table.kv_len.tolist() == [9, 4, 0, 13]
    assert all(t.dtype == torch.int32 for t in (table.indptr, table.indices, table.last_page_len, table.kv_len))


def gather_csr(cache, indptr, indices, seq, length):   # [pages, page_size, ...] -> [length, ...]
    pages = indices[indptr[seq] : indptr[seq + 1]].long()
    return cache[pages].flatten(0, 1)[:length]


@dataclass
class FakePagedWrapper:
    """Does what FlashInfer's paged prefill / decode wrappers document, in torch, from the planned page table."""

    causal_prefill: bool
    plans: list = field(default_factory=list)

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, kv):
        k_cache, v_cache = kv
        args, kwargs = self.plans[-1]
        if self.causal_prefill:
            qo_indptr, indptr, indices, last, heads, kv_heads, dim, page_size = args
            assert kwargs["causal"] and kwargs["window_left"] == -1
        else:
            indptr, indices, last, heads, kv_heads, dim, page_size = args
            qo_indptr = torch.arange(len(indptr), dtype=torch.int32)
        assert (heads, kv_heads, dim, page_size) == (q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1])
        assert ((last >= 1) & (last <= page_size)).all()
        out = []
        for seq in range(len(indptr) - 1):
            length = int((indptr[seq + 1] - indptr[seq] - 1) * page_size + last[seq])
            keys = gather_csr(k_cache, indptr, indices, seq, length).repeat_interleave(heads // kv_heads, 1)
            values = gather_csr(v_cache, indptr, indices, seq, length).repeat_interleave(heads // kv_heads, 1)
            rows = q[qo_indptr[seq] : qo_indptr[seq + 1]]
            scores = torch.einsum("nhd,shd->hns", rows, keys) * kwargs["sm_scale"]
            n = rows.shape[0]
            allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]   # bottom-right causal
            out.append(torch.einsum("hns,shd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), values))
        return torch.cat(out)


@dataclass
class FakeMLAWrapper:
    plans: list = field(default_factory=list)

    def plan(self, *args):
        self.plans.append(args)

    def run(self, q_nope, q_pe, ckv, kpe):
        qo_indptr, indptr, indices, kv_len, heads, dim_ckv, dim_kpe, page_size, causal, scale, *_ = self.plans[-1]
        assert (dim_ckv, dim_kpe, heads) == (ckv.shape[-1], kpe.shape[-1], q_nope.shape[1]) == (512, 64, q_pe.shape[1])
        out = []
        for seq in range(len(indptr) - 1):
            length = int(kv_len[seq])
            latent, rope = gather_csr(ckv, indptr, indices, seq, length), gather_csr(kpe, indptr, indices, seq, length)
            rows = slice(qo_indptr[seq], qo_indptr[seq + 1])
            scores = (q_nope[rows] @ latent.T + q_pe[rows] @ rope.T) * scale       # [n, h, S]
            n = scores.shape[0]
            if causal:
                allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
                scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
            out.append(scores.softmax(-1) @ latent)
        return torch.cat(out)


@dataclass
class FakeWrappers:
    built: list = field(default_factory=list)

    def prefill(self, workspace):
        return self._keep(FakePagedWrapper(causal_prefill=True))

    def decode(self, workspace, use_tensor_cores):
        return self._keep(FakePagedWrapper(causal_prefill=False))

    def mla(self, workspace):
        return self._keep(FakeMLAWrapper())

    def _keep(self, wrapper):
        self.built.append(wrapper)
        return wrapper


def paged(context_lens, kv_heads, dim, page_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    needed = [(n + page_size - 1) // page_size for n in context_lens]
    k_cache = torch.randn(sum(needed) + 2, page_size, kv_heads, dim, generator=generator)
    free = torch.randperm(k_cache.shape[0], generator=generator).tolist()
    tables = torch.full((len(context_lens), max(needed) + 1), -1, dtype=torch.int32)
    for seq, need in enumerate(needed):
        tables[seq, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
    return k_cache, generator, tables


def test_gqa_decode_and_prefill_through_the_fake_wrappers_plan_once_per_step():
    context = [9, 4, 13]
    k_cache, generator, tables = paged(context, 2, 64, 4)
    v_cache = torch.randn(k_cache.shape, generator=generator)
    wrappers = FakeWrappers()
    attention = FlashInferAttention(wrappers, torch.device("cpu"))
    q = torch.randn(3, 8, 64, generator=generator)
    lens = torch.tensor(context, dtype=torch.int32)
    for _ in range(2):   # two layers of one step: one plan
        got = attention.decode(q, k_cache, v_cache, tables, lens, 0.125)
        torch.testing.assert_close(got, torch_decode(q, k_cache, v_cache, tables, lens, 0.125), rtol=1e-5, atol=1e-5)
    assert len(wrappers.built) == 1 and len(wrappers.built[0].plans) == 1
    batch = PagedPrefillBatch.build([5, 4, 2], context, tables, 4)
    q = torch.randn(11, 8, 64, generator=generator)
    got = attention.prefill(q, k_cache, v_cache, batch, 0.125)
    torch.testing.assert_close(got, torch_prefill(q, k_cache, v_cache, batch, 0.125), rtol=1e-5, atol=1e-5)
    attention.decode(q[:3], k_cache, v_cache, tables.clone(), lens, 0.125)        # a new step: planned again
    assert [len(w.plans) for w in wrappers.built] == [2, 1]


def test_mla_latent_cache_goes_to_the_mla_wrapper_as_two_views():
    context = [10, 3]
    k_cache, generator, tables = paged(context, 1, 576, 4)
    v_cache = k_cache[..., :512]
    assert is_mla_cache(k_cache, v_cache)
    attention = FlashInferAttention(FakeWrappers(), torch.device("cpu"))
    lens = torch.tensor(context, dtype=torch.int32)
    q = torch.randn(2, 4, 576, generator=generator)
    torch.testing.assert_close(attention.decode(q, k_cache, v_cache, tables, lens, 0.07),
                               torch_decode(q, k_cache, v_cache, tables, lens, 0.07), rtol=1e-4, atol=1e-4)
    batch = PagedPrefillBatch.build([4, 3], context, tables, 4)
    q = torch.randn(7, 4, 576, generator=generator)
    torch.testing.assert_close(attention.prefill(q, k_cache, v_cache, batch, 0.07),
                               torch_prefill(q, k_cache, v_cache, batch, 0.07), rtol=1e-4, atol=1e-4)


def test_shapes_flashinfer_is_built_for_and_cpu_never():
    bf16 = dict(dtype=torch.bfloat16)
    gqa = torch.zeros(4, 16, 2, 128, **bf16)
    latent = torch.zeros(4, 16, 1, 576, **bf16)
    assert shapes_supported(torch.zeros(3, 8, 128, **bf16), gqa, gqa.clone())
    assert shapes_supported(torch.zeros(3, 16, 576, **bf16), latent, latent[..., :512])
    assert not shapes_supported(torch.zeros(3, 8, 128), gqa.float(), gqa.float())                 # fp32: Triton
    assert not shapes_supported(torch.zeros(3, 8, 96, **bf16), gqa[..., :96], gqa[..., :96])       # head dim 96
    small = torch.zeros(4, 16, 1, 24, **bf16)
    assert not shapes_supported(torch.zeros(3, 4, 24, **bf16), small, small[..., :16])             # not 512 + 64
    attention = FlashInferAttention(FakeWrappers(), torch.device("cpu"))
    assert not attention.supports(torch.zeros(3, 8, 128, **bf16), gqa, gqa.clone())                # not CUDA


def test_the_seam_takes_triton_where_flashinfer_does_not_apply_and_torch_on_cpu():
    calls = []
    first = FlashInferFirst(FlashInferAttention(FakeWrappers(), torch.device("cpu")),
                            lambda *args, **kwargs: calls.append("triton decode") or "decoded",
                            lambda *args, **kwargs: calls.append("triton prefill") or "prefilled")
    k_cache, _, tables = paged([5], 2, 128, 4)
    assert first.decode(torch.zeros(1, 4, 128), k_cache, k_cache, tables, torch.tensor([5]), 1.0) == "decoded"
    batch = PagedPrefillBatch.build([2], [5], tables, 4)
    assert first.prefill(torch.zeros(2, 4, 128), k_cache, k_cache, batch, 1.0) == "prefilled"
    assert calls == ["triton decode", "triton prefill"]
    cpu = attention_kernels_for(get_kernels("cpu", "torch"), torch.device("cpu"))
    assert cpu.name == "torch" and cpu.prefill is None     # CPU prefill: the per-sequence flash path
