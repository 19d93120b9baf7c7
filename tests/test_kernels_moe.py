"""Fast torch MoE path (permute, expert MLP, unpermute, fused_moe) against the naive oracle and HF."""
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from kernels import PermutePlan, get_kernels

FAST = get_kernels("cpu", "torch")
ORACLE = get_kernels("cpu", "reference")

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
