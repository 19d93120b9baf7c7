"""Each Triton kernel against its torch twin (collected by test_kernels_triton.py).

With CUDA the kernels run compiled, in bf16 and fp32, plus one larger shape; on CPU they run in the
Triton interpreter in fp32 and fp16 on tiny shapes, in a child process started with
TRITON_INTERPRET=1 (the interpreter must be on before triton is first imported).
"""
import os

import pytest
import torch
from dispatch_cases import DEEPEP_BACKENDS, MULTI_RANK_BACKENDS
from host_reads import HostReadWatch
from moe_seam_cases import LOCAL, check_seam_results, seam_on_rank

from moe_runtime.kernels import RoutingConfig, get_kernels
from mixed_attention_cases import attend, mixed_attention_case
from multirank import ranks  # noqa: F401  (fixture)

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32, torch.float16]
ORACLE = get_kernels("cpu", "reference")
TWIN = get_kernels("cpu", "torch")

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton_kernel_cases.py runs on CUDA or with TRITON_INTERPRET=1 set before triton is imported")


@pytest.fixture(scope="module")
def triton_kernels():
    return get_kernels(DEVICE, "triton")


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}[dtype]


def on_device(*tensors, dtype=None):
    return [t.to(DEVICE, dtype=dtype if t.is_floating_point() and dtype else t.dtype) for t in tensors]


# ---------------------------------------------------------------------------------------------- routing

ROUTINGS = {
    "softmax_renorm": (RoutingConfig(top_k=2, renormalize=True), False),
    "softmax_plain": (RoutingConfig(top_k=4), False),
    "v2_group_max": (RoutingConfig(top_k=3, num_groups=4, topk_groups=2, group_score="max",
                                   routed_scaling_factor=1.5), False),
    "v3_sigmoid_groups": (RoutingConfig(top_k=4, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2,
                                        group_score="top2_sum", routed_scaling_factor=2.5), True),
    "v3_one_group": (RoutingConfig(top_k=4, scoring="sigmoid", renormalize=True, group_score="top2_sum"), True),
    "top1": (RoutingConfig(top_k=1), False),
}


@pytest.mark.parametrize("tokens", [0, 1, 13])
@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_select_experts(triton_kernels, name, tokens):
    config, with_bias = ROUTINGS[name]
    experts = 16
    generator = torch.Generator().manual_seed(tokens)
    # Distinct, exactly representable logits: no ties whose order the two implementations may break differently.
    logits = torch.rand(tokens, experts, generator=generator).argsort(dim=-1).float() / 4.0
    bias = torch.randn(experts, generator=generator) * 0.3 if with_bias else None
    for dtype in DTYPES:
        dev_logits, = on_device(logits, dtype=dtype)
        got = triton_kernels.select_experts(dev_logits, config, bias.to(DEVICE) if with_bias else None)
        expected = TWIN.select_experts(logits, config, bias)
        got_ids, got_order = got.ids.cpu().sort(dim=-1)
        want_ids, want_order = expected.ids.sort(dim=-1)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got.weights.cpu().gather(1, got_order), expected.weights.gather(1, want_order),
                                   rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------- permute, GEMM, reduce

MOE_CASES = {
    "empty_batch": dict(tokens=0, top_k=2, experts=4),
    "one_token": dict(tokens=1, top_k=2, experts=8),
    "empty_experts": dict(tokens=3, top_k=2, experts=16),
    "duplicates_on_rank": dict(tokens=9, top_k=4, experts=3, duplicates=True),
    "masked_slots": dict(tokens=11, top_k=3, experts=6, masked=0.4),
    "all_masked": dict(tokens=4, top_k=2, experts=5, masked=1.0),
    "several_tiles_per_expert": dict(tokens=40, top_k=4, experts=4),
    "block_m_64_partial_tile": dict(tokens=40, top_k=2, experts=2),
}
if ON_CUDA:
    MOE_CASES["large"] = dict(tokens=512, top_k=4, experts=16, hidden=256, intermediate=192)


def moe_inputs(tokens, top_k, experts, duplicates=False, masked=0.0, hidden=24, intermediate=20, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate ** 0.5
    if duplicates:
        ids = torch.randint(0, experts, (tokens, top_k), generator=generator)
    else:
        ids = torch.rand(tokens, experts, generator=generator).argsort(dim=-1)[:, :top_k]
    if masked:
        drop = torch.rand(tokens, top_k, generator=generator) < masked
        ids = torch.where(drop, torch.where(torch.rand(tokens, top_k, generator=generator) < 0.5, -1, experts), ids)
    weights = torch.rand(tokens, top_k, generator=generator)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_permute_by_expert(triton_kernels, case):
    _, _, _, _, ids = moe_inputs(**MOE_CASES[case])
    experts = MOE_CASES[case]["experts"]
    got = triton_kernels.permute_by_expert(ids.to(DEVICE), experts)
    expected = TWIN.permute_by_expert(ids, experts)
    for field in ("token_index", "flat_index", "counts", "offsets"):
        assert torch.equal(getattr(got, field).cpu(), getattr(expected, field)), field


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_align_block_size_pads_each_expert_to_whole_tiles(triton_kernels, case):
    from moe_runtime.kernels.triton_impl.align import align_block_size

    _, _, _, _, ids = moe_inputs(**MOE_CASES[case])
    experts, block_m = MOE_CASES[case]["experts"], 16
    aligned = align_block_size(ids.to(DEVICE), experts, block_m)
    rows = aligned.schedule.padded_rows.cpu()
    block_expert = aligned.schedule.block_expert.cpu()
    flat_ids = ids.reshape(-1)
    for tile, expert in enumerate(block_expert.tolist()):
        tile_rows = rows[tile * block_m:(tile + 1) * block_m]
        live = tile_rows[tile_rows >= 0]
        if expert < 0:
            assert live.numel() == 0
        else:
            assert live.numel() > 0 and torch.all(flat_ids[live] == expert)
    assert sorted(rows[rows >= 0].tolist()) == sorted(((flat_ids >= 0) & (flat_ids < experts)).nonzero().flatten().tolist())
    slots = aligned.padded_slot.cpu()
    assert torch.equal(rows[slots[slots >= 0]], (slots >= 0).nonzero().flatten())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_fused_moe_and_its_stages(triton_kernels, case, dtype):
    x, w13, w2, weights, ids = moe_inputs(**MOE_CASES[case])
    tol = tolerance(dtype)
    x_d, w13_d, w2_d = on_device(x, w13, w2, dtype=dtype)
    weights_d, ids_d = on_device(weights, ids)
    # Oracle on the same rounded inputs, computed in fp32.
    x32, w13_32, w2_32 = (t.float().cpu() for t in (x_d, w13_d, w2_d))
    got = triton_kernels.fused_moe(x_d, w13_d, w2_d, weights_d, ids_d)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float().cpu(), ORACLE.fused_moe(x32, w13_32, w2_32, weights, ids), **tol)

    plan = TWIN.permute_by_expert(ids, w13.shape[0])
    x_sorted = x32[plan.token_index]
    out_sorted = triton_kernels.expert_mlp(x_sorted.to(DEVICE, dtype), plan.counts.to(DEVICE), w13_d, w2_d)
    expected_sorted = TWIN.expert_mlp(x_sorted, plan.counts, w13_32, w2_32)
    torch.testing.assert_close(out_sorted.float().cpu(), expected_sorted, **tol)

    device_plan = type(plan)(*(t.to(DEVICE) for t in (plan.token_index, plan.flat_index, plan.counts, plan.offsets)))
    reduced = triton_kernels.unpermute_reduce(expected_sorted.to(DEVICE, dtype), device_plan, weights_d, x.shape[0])
    expected_reduced = TWIN.unpermute_reduce(expected_sorted.to(dtype).float(), plan, weights, x.shape[0])
    torch.testing.assert_close(reduced.float().cpu(), expected_reduced, **tol)


# Counts on the device, read there: idle experts, full ones (count == M), one past M (the kernel reads
# it as M: no host read may check it). M = 5 fits one BLOCK_M tile, M = 20 takes two.
MASKED_CASES = {"one_tile": (5, [0, 5, 1, 3]), "all_idle": (5, [0, 0, 0, 0]), "all_full": (5, [5, 5, 5, 5]),
                "two_tiles": (20, [20, 17, 16, 0]), "count_past_capacity": (5, [7, 5, 0, 2])}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(MASKED_CASES))
def test_masked_expert_mlp(triton_kernels, case, dtype):
    """Valid rows match the reference, NaN in the stale rows past each count never reaches them, and the
    call neither reads the counts back to the host nor zero-fills its [E, M, H] output (rows past a count
    are undefined: DeepEP's combine reads only rows below it)."""
    capacity, counts = MASKED_CASES[case]
    x, w13, w2, _, _ = moe_inputs(tokens=4 * capacity, top_k=1, experts=4)
    x = x.view(4, capacity, 24)
    counts = torch.tensor(counts)
    valid = torch.arange(capacity)[None, :] < counts[:, None]                 # [E, M]
    x[~valid] = float("nan")                                                  # a dispatch buffer's stale rows
    x_d, w13_d, w2_d = on_device(x, w13, w2, dtype=dtype)
    with HostReadWatch(min_fill_elements=x.numel()) as watch:
        got = triton_kernels.masked_expert_mlp(x_d, counts.to(DEVICE), w13_d, w2_d)
    assert watch.host_reads == [] and watch.fills == [], (watch.host_reads, watch.fills)
    assert got.shape == x.shape and got.dtype == dtype
    expected = ORACLE.masked_expert_mlp(*(t.float().cpu() for t in (torch.nan_to_num(x_d), counts.clamp(max=capacity),
                                                                        w13_d, w2_d)))
    torch.testing.assert_close(got.float().cpu()[valid], expected[valid], **tolerance(dtype))


# ------------------------------------------------------------------------- the MoE seam, Triton experts

# Every dispatcher with the Triton expert kernels (test_moe_seam_contract.py runs the torch and reference
# families). The multi-rank dispatchers run on gloo, which moves CPU tensors: on CUDA only the local one.
# DeepEP moves bf16 rows only (moe_runtime/dispatch/deepep_preconditions.py) and the interpreter computes no bf16, so
# on CPU the DeepEP seam runs with the torch families only; the local "masked" scenario keeps the masked layout.
SEAM_BACKENDS = [LOCAL] if ON_CUDA else [LOCAL] + [b for b in MULTI_RANK_BACKENDS if b not in DEEPEP_BACKENDS]


@pytest.mark.parametrize("backend", SEAM_BACKENDS)
def test_moe_seam_with_triton_experts(ranks, backend):
    for scenario in ("uneven", "masked"):
        if backend == LOCAL:
            results = [seam_on_rank(LOCAL, scenario, "triton", "float32", DEVICE)]
        else:
            results = ranks(2).run(seam_on_rank, backend, scenario, "triton")
        check_seam_results(results, tolerance=1e-4)


# ------------------------------------------------------------------------------------- norm, attention

@pytest.mark.parametrize("tokens", [0, 1, 6])
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm(triton_kernels, tokens, hidden):
    generator = torch.Generator().manual_seed(hidden)
    x, residual, weight = (torch.randn(*shape, generator=generator) for shape in
                           ((tokens, hidden), (tokens, hidden), (hidden,)))
    for dtype in DTYPES:
        x_d, r_d, w_d = on_device(x, residual, weight, dtype=dtype)
        x32, r32, w32 = (t.float().cpu() for t in (x_d, r_d, w_d))
        torch.testing.assert_close(triton_kernels.rms_norm(x_d, w_d, 1e-6).float().cpu(),
                                   TWIN.rms_norm(x_d.cpu(), w_d.cpu(), 1e-6).float(), **tolerance(dtype))
        fused = triton_kernels.fused_add_rms_norm(x_d, r_d, w_d, 1e-5)
        expected = TWIN.fused_add_rms_norm(x_d.cpu(), r_d.cpu(), w_d.cpu(), 1e-5)
        torch.testing.assert_close(fused.out.float().cpu(), expected.out.float(), **tolerance(dtype))
        assert torch.equal(fused.residual.cpu(), expected.residual)
        assert x32.shape == r32.shape == (tokens, hidden) and w32.shape == (hidden,)


ATTENTION_CASES = {
    "gqa": dict(context_lens=[1, 5, 16, 17], q_heads=4, kv_heads=2, head_dim=8, v_dim=8, block_size=4),
    "mqa_wide_group_uses_dot": dict(context_lens=[9, 3], q_heads=16, kv_heads=1, head_dim=16, v_dim=16, block_size=8),
    "empty_sequence": dict(context_lens=[0, 6], q_heads=2, kv_heads=2, head_dim=8, v_dim=8, block_size=4),
    "mla_shared_cache": dict(context_lens=[7, 12, 2], q_heads=4, kv_heads=1, head_dim=24, v_dim=16, block_size=4,
                             shared_kv=True),
    "odd_block_size": dict(context_lens=[7, 2], q_heads=2, kv_heads=1, head_dim=8, v_dim=8, block_size=3),
    "empty_batch": dict(context_lens=[], q_heads=2, kv_heads=1, head_dim=8, v_dim=8, block_size=4),
}
if ON_CUDA:
    ATTENTION_CASES["large"] = dict(context_lens=[1, 100, 1000, 333], q_heads=32, kv_heads=8, head_dim=128,
                                    v_dim=128, block_size=16)


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_decode_attention(triton_kernels, case):
    spec = dict(ATTENTION_CASES[case])
    lens, q_heads, kv_heads = spec["context_lens"], spec["q_heads"], spec["kv_heads"]
    head_dim, v_dim, block_size = spec["head_dim"], spec["v_dim"], spec["block_size"]
    generator = torch.Generator().manual_seed(len(lens))
    blocks_needed = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks_needed) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    v_cache = k_cache[..., :v_dim] if spec.get("shared_kv") else torch.randn(
        num_blocks, block_size, kv_heads, v_dim, generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(lens), max(blocks_needed + [1]) + 1), -1, dtype=torch.int32)
    for seq, need in enumerate(blocks_needed):
        tables[seq, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), q_heads, head_dim, generator=generator)
    for dtype in DTYPES:
        q_d, k_d = on_device(q, k_cache, dtype=dtype)
        v_d = k_d[..., :v_dim] if spec.get("shared_kv") else v_cache.to(DEVICE, dtype)
        got = triton_kernels.paged_decode_attention(q_d, k_d, v_d, tables.to(DEVICE), context_lens.to(DEVICE),
                                                    head_dim ** -0.5)
        expected = TWIN.paged_decode_attention(q_d.float().cpu(), k_d.float().cpu(), v_d.float().cpu(), tables,
                                               context_lens, head_dim ** -0.5)
        assert got.shape == (len(lens), q_heads, v_dim) and got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), expected, **tolerance(dtype))


@pytest.mark.parametrize("window", [None, 6])
def test_mixed_batch_one_token_rows_through_the_paged_kernel(triton_kernels, window):
    """Chunked prefill's mixed steps: decodes through this kernel (on a subset of the batch's block tables),
    chunks with cached context through the torch path; together, dense attention over each sequence."""
    case = mixed_attention_case(8, 2, window, shared_kv=False, device=DEVICE)
    torch.testing.assert_close(attend(triton_kernels, case).cpu(), case.expected, **tolerance(torch.float32))
