"""select_experts against the transformers 5.x router modules of every supported architecture."""
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moe_runtime.kernels import RoutingConfig, TopK, get_kernels, select_experts

HIDDEN, EXPERTS, TOKENS = 32, 16, 37


def mixtral():
    config = MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=2)
    return MixtralTopKRouter(config), RoutingConfig(top_k=2, renormalize=True), None


def qwen_like(config_cls, router_cls, norm_topk_prob):
    def build():
        config = config_cls(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=4,
                            norm_topk_prob=norm_topk_prob)
        return router_cls(config), RoutingConfig(top_k=4, renormalize=norm_topk_prob), None
    return build


def deepseek_v2(topk_method, n_group, topk_group, scaling):
    def build():
        config = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3,
                                  topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                                  routed_scaling_factor=scaling, norm_topk_prob=True)
        grouped = topk_method == "group_limited_greedy"
        # The V2 router ignores norm_topk_prob: weights are never renormalized.
        routing = RoutingConfig(top_k=3, renormalize=False, num_groups=n_group if grouped else 1,
                                topk_groups=topk_group if grouped else 1, group_score="max",
                                routed_scaling_factor=scaling)
        return DeepseekV2TopkRouter(config), routing, None
    return build


def deepseek_v3(n_group, topk_group, norm_topk_prob, scaling):
    def build():
        config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4,
                                  n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                  routed_scaling_factor=scaling)
        router = DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.normal_(0.0, 0.5)   # large enough to change the choice
        routing = RoutingConfig(top_k=4, scoring="sigmoid", renormalize=norm_topk_prob, num_groups=n_group,
                                topk_groups=topk_group, group_score="top2_sum", routed_scaling_factor=scaling)
        return router, routing, router.e_score_correction_bias
    return build


ARCHITECTURES = {
    "mixtral": mixtral,
    "qwen2_moe": qwen_like(Qwen2MoeConfig, Qwen2MoeTopKRouter, False),
    "qwen2_moe_norm": qwen_like(Qwen2MoeConfig, Qwen2MoeTopKRouter, True),
    "qwen3_moe": qwen_like(Qwen3MoeConfig, Qwen3MoeTopKRouter, True),
    "qwen3_moe_no_norm": qwen_like(Qwen3MoeConfig, Qwen3MoeTopKRouter, False),
    "olmoe": qwen_like(OlmoeConfig, OlmoeTopKRouter, False),
    "deepseek_v2_greedy": deepseek_v2("greedy", 1, 1, 16.0),
    "deepseek_v2_group_limited": deepseek_v2("group_limited_greedy", 4, 2, 1.5),
    "deepseek_v3": deepseek_v3(4, 2, True, 2.5),
    "deepseek_v3_one_group": deepseek_v3(1, 1, True, 1.0),
    "deepseek_v3_no_norm": deepseek_v3(8, 3, False, 2.5),
}


def sorted_by_id(topk: TopK):
    ids, order = topk.ids.sort(dim=-1)
    return ids, topk.weights.gather(1, order)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("family", ["torch", "reference"])
def test_select_experts_matches_hf_router(arch, family):
    torch.manual_seed(0)
    router, routing, bias = ARCHITECTURES[arch]()
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        hidden = torch.randn(TOKENS, HIDDEN)
        logits, hf_weights, hf_ids = router(hidden)
    ours = get_kernels("cpu", family).select_experts(logits, routing, bias)
    assert ours.ids.dtype == torch.int64 and ours.weights.dtype == torch.float32
    ours_ids, ours_weights = sorted_by_id(ours)
    hf_ids, hf_weights = sorted_by_id(TopK(weights=hf_weights.float(), ids=hf_ids))
    assert torch.equal(ours_ids, hf_ids), f"{arch}: expert choice differs from transformers"
    torch.testing.assert_close(ours_weights, hf_weights, rtol=0, atol=1e-6)


def test_bias_changes_the_choice_but_not_the_weights_source():
    """The correction bias picks experts; the weights still come from the unbiased sigmoid scores."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    topk = select_experts(logits, RoutingConfig(top_k=1, scoring="sigmoid"), bias)
    assert topk.ids.tolist() == [[0]]
    torch.testing.assert_close(topk.weights, torch.sigmoid(torch.tensor([[0.0]])))


def test_empty_batch_and_bf16_logits():
    for dtype in (torch.float32, torch.bfloat16):
        topk = select_experts(torch.zeros(0, 8, dtype=dtype), RoutingConfig(top_k=2, renormalize=True))
        assert topk.ids.shape == (0, 2) and topk.weights.dtype == torch.float32
    grouped = RoutingConfig(top_k=2, scoring="sigmoid", num_groups=4, topk_groups=2, group_score="top2_sum")
    assert select_experts(torch.zeros(0, 8), grouped, torch.zeros(8)).ids.shape == (0, 2)
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    topk = select_experts(logits, RoutingConfig(top_k=2, renormalize=True))
    torch.testing.assert_close(topk.weights.sum(-1), torch.ones(5))


@pytest.mark.parametrize("bad", [
    dict(top_k=0), dict(top_k=2, scoring="relu"), dict(top_k=2, group_score="mean"),
    dict(top_k=2, num_groups=2, topk_groups=3),
])
def test_bad_config_is_named(bad):
    with pytest.raises(ValueError, match="RoutingConfig"):
        RoutingConfig(**bad)


def test_config_that_cannot_fit_its_experts_is_rejected():
    with pytest.raises(ValueError, match="num_groups"):
        select_experts(torch.randn(2, 10), RoutingConfig(top_k=2, num_groups=4, topk_groups=2))
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(2, 8), RoutingConfig(top_k=5, num_groups=4, topk_groups=2))
    with pytest.raises(ValueError, match="correction_bias"):
        select_experts(torch.randn(2, 8), RoutingConfig(top_k=2), torch.zeros(7))


def test_sqrtsoftplus_matches_deepseek_v4s_router():
    """DeepSeek-V4: sqrt(softplus) scores, the correction bias for the choice only, always renormalised, scaled."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    config = DeepseekV4Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=1.5,
                              num_hidden_layers=1)
    router = DeepseekV4TopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=generator))
    hidden = torch.randn(7, 32, generator=generator)
    logits, want_weights, want_ids = router(hidden)
    routing = RoutingConfig(top_k=4, scoring="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.5)
    got = select_experts(logits, routing, router.e_score_correction_bias)
    order, want_order = got.ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(got.ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(got.weights.gather(1, order), want_weights.gather(1, want_order))
