"""Fast torch MoE path (permute, expert MLP, unpermute, fused_moe) against the naive oracle and HF."""
import importlib

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from moe_runtime.kernels import PermutePlan, get_kernels
from moe_runtime.kernels.skinny_matmul import SKINNY_ROWS_MAX, batched_linear_rows, linear_rows, weight_left_wins

FAST = get_kernels("cpu", "torch")
ORACLE = get_kernels("cpu", "reference")
expert_mlp_module = importlib.import_module("moe_runtime.kernels.expert_mlp")  # the package re-exports a function of that name

DEVICE_DTYPES = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
if torch.cuda.is_available():
    DEVICE_DTYPES.append(("cuda", torch.bfloat16))


def tolerance(dtype):
    return dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)


def make_layer(tokens, hidden, experts, intermediate, device="cpu", dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate ** 0.5
    return [t.to(device=device, dtype=dtype) for t in (x, w13, w2)]


def random_topk(tokens, top_k, experts, device="cpu", seed=0, allow_duplicates=False, masked_fraction=0.0):
    generator = torch.Generator().manual_seed(seed)
    if allow_duplicates:
        ids = torch.randint(0, experts, (tokens, top_k), generator=generator)
    else:
        ids = torch.rand(tokens, experts, generator=generator).argsort(dim=-1)[:, :top_k]
    if masked_fraction:
        drop = torch.rand(tokens, top_k, generator=generator) < masked_fraction
        ids = torch.where(drop, torch.where(torch.rand(tokens, top_k, generator=generator) < 0.5, -1, experts), ids)
    weights = torch.rand(tokens, top_k, generator=generator)
    return weights.to(device), ids.to(device)


CASES = {
    "empty_batch": dict(tokens=0, top_k=2, experts=4),
    "one_token": dict(tokens=1, top_k=2, experts=8),
    "more_experts_than_pairs": dict(tokens=3, top_k=2, experts=16),
    "duplicates_on_rank": dict(tokens=9, top_k=4, experts=3, allow_duplicates=True),
    "masked_slots": dict(tokens=11, top_k=3, experts=6, masked_fraction=0.4),
    "all_masked": dict(tokens=4, top_k=2, experts=5, masked_fraction=1.0),
    "single_expert": dict(tokens=7, top_k=1, experts=1),
    "busy": dict(tokens=64, top_k=4, experts=8),
    "decode_batch": dict(tokens=16, top_k=4, experts=32),   # small counts on most experts: padded path
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_permute_plan_is_a_stable_expert_sort(case):
    spec = dict(CASES[case])
    tokens, top_k, experts = spec.pop("tokens"), spec.pop("top_k"), spec.pop("experts")
    _, ids = random_topk(tokens, top_k, experts, **spec)
    fast, oracle = FAST.permute_by_expert(ids, experts), ORACLE.permute_by_expert(ids, experts)
    for field in ("token_index", "flat_index", "counts", "offsets"):
        assert torch.equal(getattr(fast, field), getattr(oracle, field)), field
    assert fast.counts.shape == (experts,) and fast.offsets.shape == (experts + 1,)
    flat_ids = ids.reshape(-1)[fast.flat_index]
    assert torch.all(flat_ids[1:] >= flat_ids[:-1])                  # expert order
    assert torch.all((flat_ids >= 0) & (flat_ids < experts))          # masked slots dropped


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_moe_matches_every_expert_oracle(case, device, dtype):
    spec = dict(CASES[case])
    tokens, top_k, experts = spec.pop("tokens"), spec.pop("top_k"), spec.pop("experts")
    x, w13, w2 = make_layer(tokens, 24, experts, 20, device, dtype)
    weights, ids = random_topk(tokens, top_k, experts, device, **spec)
    expected = ORACLE.fused_moe(x.float().cpu(), w13.float().cpu(), w2.float().cpu(), weights.cpu(), ids.cpu())
    got = FAST.fused_moe(x, w13, w2, weights, ids)
    assert got.shape == (tokens, 24) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected, **tolerance(dtype))


@pytest.mark.parametrize("case", ["one_token", "duplicates_on_rank", "masked_slots", "busy"])
def test_stages_match_oracle_stages(case):
    spec = dict(CASES[case])
    tokens, top_k, experts = spec.pop("tokens"), spec.pop("top_k"), spec.pop("experts")
    x, w13, w2 = make_layer(tokens, 16, experts, 12)
    weights, ids = random_topk(tokens, top_k, experts, **spec)
    plan = FAST.permute_by_expert(ids, experts)
    x_sorted = x[plan.token_index]
    out_sorted = FAST.expert_mlp(x_sorted, plan.counts, w13, w2)
    torch.testing.assert_close(out_sorted, ORACLE.expert_mlp(x_sorted, plan.counts, w13, w2), rtol=0, atol=1e-5)
    torch.testing.assert_close(FAST.unpermute_reduce(out_sorted, plan, weights, tokens),
                               ORACLE.unpermute_reduce(out_sorted, plan, weights, tokens), rtol=0, atol=1e-5)


def test_fused_moe_matches_transformers_experts_module():
    """The HF Qwen3-MoE experts module (same stacked weight layout) is a second, independent oracle."""
    config = Qwen3MoeConfig(hidden_size=32, num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2)
    module = Qwen3MoeExperts(config)
    x, w13, w2 = make_layer(13, 32, 8, 16, seed=3)
    with torch.no_grad():
        module.gate_up_proj.copy_(w13)
        module.down_proj.copy_(w2)
        weights, ids = random_topk(13, 2, 8, seed=3)
        expected = module(x, ids, weights)
    torch.testing.assert_close(FAST.fused_moe(x, w13, w2, weights, ids), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_masked_expert_mlp_zeroes_rows_past_count(device, dtype):
    experts, capacity = 4, 5
    x, w13, w2 = make_layer(experts * capacity, 16, experts, 8, device, dtype)
    x = x.view(experts, capacity, 16)
    counts = torch.tensor([0, 5, 1, 3], device=device)
    got = FAST.masked_expert_mlp(x, counts, w13, w2)
    expected = ORACLE.masked_expert_mlp(x.float().cpu(), counts.cpu(), w13.float().cpu(), w2.float().cpu())
    torch.testing.assert_close(got.float().cpu(), expected, **tolerance(dtype))
    assert torch.all(got[0] == 0) and torch.all(got[2, 1:] == 0) and torch.all(got[3, 3:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_and_per_expert_paths_agree_with_the_oracle(dtype, monkeypatch):
    x, w13, w2 = make_layer(16, 32, 32, 24, dtype=dtype, seed=5)
    weights, ids = random_topk(16, 4, 32, seed=5)
    plan = FAST.permute_by_expert(ids, 32)
    assert expert_mlp_module.padded_layout_wins(plan.counts, int(plan.counts.max()))   # the case is decode-shaped
    expected = ORACLE.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    padded = FAST.fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setattr(expert_mlp_module, "PADDED_BUSY_FRACTION_MIN", 2.0)        # never padded
    assert not expert_mlp_module.padded_layout_wins(plan.counts, int(plan.counts.max()))
    per_expert = FAST.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(padded.float(), expected, **tolerance(dtype))
    torch.testing.assert_close(per_expert.float(), expected, **tolerance(dtype))


def test_padded_path_is_chosen_only_for_small_counts_on_most_experts():
    wins = expert_mlp_module.padded_layout_wins
    assert wins(torch.tensor([1, 2, 1, 0]), 2)
    assert not wins(torch.tensor([1, 0, 0, 0]), 1)                              # one busy expert of four
    assert not wins(torch.tensor([SKINNY_ROWS_MAX + 1, 3, 2, 1]), SKINNY_ROWS_MAX + 1)  # prefill-sized segment
    assert not wins(torch.zeros(4, dtype=torch.int64), 0)


def test_masked_expert_mlp_ignores_stale_rows_even_when_nan():
    experts, capacity = 4, 6
    x, w13, w2 = make_layer(experts * capacity, 16, experts, 8, seed=2)
    x = x.view(experts, capacity, 16).clone()
    counts = torch.tensor([2, 0, 1, 3])
    x[0, 2:] = float("nan")                                                    # a dispatch buffer's stale rows
    x[2, 1:] = float("inf")
    got = FAST.masked_expert_mlp(x, counts, w13, w2)
    expected = ORACLE.masked_expert_mlp(torch.nan_to_num(x), counts, w13, w2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, SKINNY_ROWS_MAX, SKINNY_ROWS_MAX + 1, 33])
def test_linear_rows_is_f_linear(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=generator).to(dtype)
    weight = torch.randn(40, 48, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype)
    for args in ((x, weight), (x, weight, bias), (x[:, ::2], weight[:, ::2])):  # also a strided x
        got = linear_rows(*args)
        assert got.shape == (rows, 40) and got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(*args).float(), **tolerance(dtype))


def test_weight_left_order_only_where_it_was_measured_to_win():
    def wins(rows, in_features, batched=False, dtype=torch.float32):
        return weight_left_wins(torch.empty(rows, in_features, dtype=dtype), rows, batched)
    assert wins(2, 4096) and wins(1, 512) and wins(4, 512) and wins(8, 256)
    assert wins(1, 4096, batched=True)
    assert not wins(1, 2048)                        # gemv is better for one long row
    assert not wins(4, 2048) and not wins(8, 512)   # activation block too large
    assert not wins(SKINNY_ROWS_MAX + 1, 64) and not wins(0, 64)
    assert not wins(2, 512, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, SKINNY_ROWS_MAX + 2])
def test_batched_linear_rows_is_per_batch_f_linear(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(5, rows, 24, generator=generator).to(dtype)
    weight = torch.randn(5, 20, 24, generator=generator).to(dtype)
    got = batched_linear_rows(x, weight)
    expected = torch.stack([torch.nn.functional.linear(x[b], weight[b]) for b in range(5)])
    assert got.shape == (5, rows, 20)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))


def test_bad_shapes_name_the_tensor():
    x, w13, w2 = make_layer(3, 16, 4, 8)
    weights, ids = random_topk(3, 2, 4)
    with pytest.raises(ValueError, match="w13"):
        FAST.fused_moe(x, w13[:, :, :8], w2, weights, ids)
    with pytest.raises(ValueError, match="w2"):
        FAST.fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        FAST.fused_moe(x, w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="counts"):
        FAST.expert_mlp(x, torch.tensor([1, 1, 0, 0]), w13, w2)


def test_plan_is_a_dataclass_with_documented_fields():
    plan = FAST.permute_by_expert(torch.tensor([[2, 0], [2, 1]]), 3)
    assert isinstance(plan, PermutePlan)
    assert plan.token_index.tolist() == [0, 1, 0, 1]
    assert plan.flat_index.tolist() == [1, 3, 0, 2]
    assert plan.counts.tolist() == [1, 1, 2] and plan.offsets.tolist() == [0, 1, 2, 4]
