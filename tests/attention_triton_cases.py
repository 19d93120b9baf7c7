"""The Triton attention kernels (varlen paged prefill, split-context decode) against their torch twins and a
float64 reference, and the layers' seam through them (collected by test_attention_kernels_triton.py).

With CUDA they run compiled in bf16 and fp32; on CPU in the Triton interpreter (fp32, fp16) on small
shapes, in a child process started with TRITON_INTERPRET=1.
"""
import os

import pytest
import torch

from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.paged_prefill_attention import PagedPrefillBatch
from moe_runtime.kernels.paged_prefill_attention import paged_prefill_attention as torch_prefill
from mixed_attention_cases import SCALE, mixed_attention_case
from paged_steps import paged_step
from moe_runtime.layers.attention_backend import attention_kernels_for
from moe_runtime.layers.attention_ops import paged_varlen_attention, split_attention
from moe_runtime.layers.attention_span import AttentionSpan

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32, torch.float16]
TWIN = get_kernels("cpu", "torch")

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("attention_triton_cases.py runs on CUDA or with TRITON_INTERPRET=1 set before triton is imported")

from moe_runtime.kernels.triton_impl import paged_attention as triton_decode              # noqa: E402  (after the check)
from moe_runtime.kernels.triton_impl import paged_prefill_attention as triton_prefill     # noqa: E402


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}[dtype]


def paged_cache(context_lens, kv_heads, head_dim, v_dim, block_size, shared_kv, seed):
    """Random K/V in shuffled blocks; block tables one column wider than needed (padding must be ignored)."""
    generator = torch.Generator().manual_seed(seed)
    needed = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(needed) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    v_cache = k_cache[..., :v_dim] if shared_kv else torch.randn(num_blocks, block_size, kv_heads, v_dim,
                                                                 generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(context_lens), max(needed + [1]) + 1), -1, dtype=torch.int32)
    for seq, need in enumerate(needed):
        tables[seq, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
    return k_cache, v_cache, tables, generator


def float64_reference(q, k_cache, v_cache, tables, query_lens, context_lens, scale, window=None):
    """Each query row against its sequence's gathered keys, in float64, masked causally (and by the window)."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out, start = [], 0
    for seq, (n, context) in enumerate(zip(query_lens, context_lens)):
        blocks = tables[seq, : (context + block_size - 1) // block_size].long()
        keys = k_cache[blocks].flatten(0, 1)[:context].double().repeat_interleave(group, dim=1)     # [S, Hq, D]
        values = v_cache[blocks].flatten(0, 1)[:context].double().repeat_interleave(group, dim=1)   # [S, Hq, Dv]
        scores = torch.einsum("nhd,shd->hns", q[start : start + n].double(), keys) * scale          # [Hq, n, S]
        query_pos = torch.arange(context - n, context)[:, None]
        key_pos = torch.arange(context)[None, :]
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= key_pos > query_pos - window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        out.append(torch.einsum("hns,shv->nhv", probs, values))
        start += n
    return torch.cat(out) if out else torch.zeros(0, q.shape[1], v_cache.shape[3], dtype=torch.float64)


# ------------------------------------------------------------------------------------------- varlen prefill

PREFILL_CASES = {
    # query_lens, context_lens: chunks after cached context (prefix-cache hits, chunked prefill), a whole
    # prompt, a one-token chunk, and sequences of different lengths in one call
    "gqa_chunks_after_cached_context": dict(query_lens=[5, 1, 7, 3], context_lens=[9, 1, 7, 20], q_heads=4,
                                            kv_heads=2, head_dim=16, v_dim=16, block_size=4),
    "mqa_odd_block_size_long_chunk": dict(query_lens=[19, 2], context_lens=[23, 2], q_heads=4, kv_heads=1,
                                          head_dim=8, v_dim=8, block_size=3),
    "mla_absorbed_latent_cache": dict(query_lens=[3, 6], context_lens=[20, 6], q_heads=8, kv_heads=1,
                                      head_dim=24, v_dim=16, block_size=4, shared_kv=True),
    "value_dim_differs": dict(query_lens=[4], context_lens=[11], q_heads=2, kv_heads=2, head_dim=16, v_dim=24,
                              block_size=4),
    "sliding_window": dict(query_lens=[5, 11], context_lens=[9, 13], q_heads=4, kv_heads=2, head_dim=16, v_dim=16,
                           block_size=4, window=4),
}


@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_varlen_prefill_matches_twin_and_float64(case):
    spec = dict(PREFILL_CASES[case])
    query_lens, context_lens, window = spec["query_lens"], spec["context_lens"], spec.get("window")
    k_cache, v_cache, tables, generator = paged_cache(context_lens, spec["kv_heads"], spec["head_dim"], spec["v_dim"],
                                                      spec["block_size"], spec.get("shared_kv", False), len(case))
    q = torch.randn(sum(query_lens), spec["q_heads"], spec["head_dim"], generator=generator)
    scale = spec["head_dim"] ** -0.5
    reference = float64_reference(q, k_cache, v_cache, tables, query_lens, context_lens, scale, window).float()
    span = AttentionSpan.coerce(window)     # the kernels take the layer's span
    twin = torch_prefill(q, k_cache, v_cache, PagedPrefillBatch.build(query_lens, context_lens, tables,
                                                                      spec["block_size"]), scale, span)
    torch.testing.assert_close(twin, reference, rtol=1e-5, atol=1e-5)
    for dtype in DTYPES:
        q_d, k_d = q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype)
        v_d = k_d[..., : spec["v_dim"]] if spec.get("shared_kv") else v_cache.to(DEVICE, dtype)
        batch = PagedPrefillBatch.build(query_lens, context_lens, tables.to(DEVICE), spec["block_size"])
        got = triton_prefill.paged_prefill_attention(q_d, k_d, v_d, batch, scale, span)
        assert got.shape == reference.shape and got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), reference, **tolerance(dtype))


def test_varlen_prefill_without_rows():
    k_cache, v_cache, tables, _ = paged_cache([3], 1, 16, 16, 4, False, 0)
    batch = PagedPrefillBatch.build([0], [3], tables, 4)
    assert triton_prefill.paged_prefill_attention(torch.zeros(0, 2, 16), k_cache, v_cache, batch, 1.0).shape == (0, 2, 16)


# ------------------------------------------------------------------------------------ split-context decode

DECODE_CASES = {
    # context_lens, heads, forced split count (None: the policy's), whether values are a view of the keys
    "gqa_three_splits_not_dividing": dict(context_lens=[1, 5, 16, 17], q_heads=4, kv_heads=2, head_dim=8, v_dim=8,
                                          block_size=4, splits=3),
    "more_splits_than_keys_and_empty_context": dict(context_lens=[0, 6, 2], q_heads=2, kv_heads=2, head_dim=8, v_dim=8,
                                                    block_size=4, splits=5),
    "mla_batch1_policy_splits": dict(context_lens=[45], q_heads=16, kv_heads=1, head_dim=24, v_dim=16, block_size=4,
                                     shared_kv=True, splits=None),
    "mla_batch1_seven_splits": dict(context_lens=[45], q_heads=16, kv_heads=1, head_dim=24, v_dim=16, block_size=4,
                                    shared_kv=True, splits=7),
    "one_split_writes_directly": dict(context_lens=[9, 3], q_heads=8, kv_heads=2, head_dim=16, v_dim=16, block_size=8,
                                      splits=1),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_split_decode_matches_twin_and_float64(case):
    spec = dict(DECODE_CASES[case])
    lens = spec["context_lens"]
    k_cache, v_cache, tables, generator = paged_cache(lens, spec["kv_heads"], spec["head_dim"], spec["v_dim"],
                                                      spec["block_size"], spec.get("shared_kv", False), len(case))
    q = torch.randn(len(lens), spec["q_heads"], spec["head_dim"], generator=generator)
    scale = spec["head_dim"] ** -0.5
    context_lens = torch.tensor(lens, dtype=torch.int32)
    reference = float64_reference(q, k_cache, v_cache, tables, [1] * len(lens), lens, scale).float()
    twin = TWIN.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(twin, reference, rtol=1e-5, atol=1e-5)
    for dtype in DTYPES:
        q_d, k_d = q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype)
        v_d = k_d[..., : spec["v_dim"]] if spec.get("shared_kv") else v_cache.to(DEVICE, dtype)
        got = triton_decode.paged_decode_attention(q_d, k_d, v_d, tables.to(DEVICE), context_lens.to(DEVICE), scale,
                                                   num_splits=spec["splits"])
        assert got.shape == reference.shape and got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), reference, **tolerance(dtype))


def test_split_policy_fills_the_device_from_static_sizes():
    policy = triton_decode.DecodeSplitPolicy(target_programs=264)
    assert policy.splits(batch=1, head_programs=8, table_width=512, block_size=16, block_n=32) == 33   # MLA, batch 1
    assert policy.splits(batch=64, head_programs=8, table_width=512, block_size=16, block_n=32) == 1   # full batch
    assert policy.splits(batch=1, head_programs=1, table_width=2, block_size=16, block_n=32) == 1      # short table
    assert policy.splits(batch=1, head_programs=1, table_width=4096, block_size=16, block_n=32) == 64  # capped


# ------------------------------------------------------------------------------------------------- the seam

@pytest.mark.parametrize("window", [None, 6])
def test_mixed_batch_through_the_triton_seam(window):
    """A step of decodes, chunks over cached context and a whole prompt: one-token rows through the split decode
    kernel, every other row through one varlen launch; together, dense attention over each sequence."""
    case = mixed_attention_case(8, 2, window, shared_kv=False, device=DEVICE)
    attention = attention_kernels_for(get_kernels(DEVICE, "triton"), torch.device(DEVICE))
    assert attention.prefill is not None
    batch, q = case.batch, case.q

    def single(rows, tables, lens, key_starts=None):   # windowed rows: from their first key
        return attention.decode(q if rows is None else q[rows], case.k_cache, case.v_cache, tables, lens, SCALE,
                                key_starts=key_starts)

    def varlen(seqs):
        return paged_varlen_attention(q, batch, attention.prefill, case.k_cache, case.v_cache, SCALE, window, seqs)

    torch.testing.assert_close(split_attention(batch, window, single, varlen).cpu(), case.expected,
                               **tolerance(torch.float32))


def test_mla_layer_absorbed_prefill_matches_expanded():
    """MultiHeadLatentAttention with the Triton family prefills absorbed (one varlen launch over the latent cache)
    and decodes through the split kernel; the torch family expands the latents per sequence. Same weights, same
    step (a chunk over cached context, a fresh prompt, a decode): the same outputs."""
    from moe_runtime.layers.kv_cache import LayerKVCache
    from moe_runtime.layers.mla import MLAShape, MultiHeadLatentAttention
    from moe_runtime.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    shape = MLAShape(hidden_size=32, num_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8)
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), 1.0, False)
    layers = {name: MultiHeadLatentAttention(shape, rotary, 0.3, get_kernels("cpu", name), torch.float32)
              for name in ("torch", "triton")}
    for name, param in layers["torch"].named_parameters():
        param.data.normal_(0, 0.3)
        dict(layers["triton"].named_parameters())[name].data.copy_(param.data)
    block_size, num_blocks = 4, 16
    cache = LayerKVCache.allocate(layers["torch"].kv_cache_spec(), num_blocks, block_size, torch.float32, "cpu")
    tables = torch.tensor([[3, 7, 1, 12], [5, 0, -1, -1], [9, 2, 14, -1]], dtype=torch.int32)

    def step(query_lens, context_lens):
        batch, positions = paged_step(tables, block_size, query_lens, context_lens)
        return batch, positions, torch.randn(batch.num_tokens, 32)

    batch, positions, x = step([6, 0, 9], [6, 0, 9])          # earlier step: the cached context
    layers["torch"](positions, x, batch, cache)
    batch, positions, x = step([5, 7, 1], [11, 7, 10])        # a chunk after 6 cached, a fresh prompt, a decode
    outputs = {}
    for name, layer in layers.items():
        layer_cache = LayerKVCache(cache.keys.clone(), None)
        outputs[name] = layer(positions, x, batch, layer_cache)
    assert layers["triton"]._attention.prefill is not None and layers["torch"]._attention.prefill is None
    torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=1e-4, atol=1e-4)
