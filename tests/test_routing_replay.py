"""Routing replay (issue 54): `return_routed_experts` gives each position's logical expert ids, equal to transformers'
router top-k and the same under every layout; `forced_routed_experts` routes the positions it covers."""
import numpy as np
import pytest
import torch

from engine_helpers import greedy
from lazy_engines import tiny_engine_pool
from moe_runtime import SamplingParams
from moe_runtime.errors import InvalidRequestError
from moe_runtime.moe.routed_experts import RoutedExpertsArray

PROMPTS = [[5, 17, 42, 99, 3, 8, 21], [77, 6]]
NEW_TOKENS = 6
LAYOUTS = {"one": {}}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory):
    with tiny_engine_pool(tiny_checkpoint_factory, LAYOUTS) as get:
        yield get


def routed(max_tokens: int = NEW_TOKENS, **kwargs) -> SamplingParams:
    return greedy(max_tokens, return_routed_experts=True, **kwargs)


def hf_router_ids(model, token_ids: list[int]) -> np.ndarray:
    """transformers' router top-k ([T, moe_layers, K], each token's ids sorted) over one forward of `token_ids`."""
    chosen = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
             for name, module in model.named_modules() if name.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return np.sort(torch.stack(chosen, dim=1).numpy(), axis=-1)                     # [T, L, K]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_returned_routing_is_transformers_router_top_k(arch, engines, hf_oracles):
    outputs = engines(arch, "one").generate(PROMPTS, routed())
    model = hf_oracles(arch).model
    for prompt, output in zip(PROMPTS, outputs):
        array = output.routed_experts
        layers = sum(1 for name, _ in model.named_modules() if name.endswith("mlp.gate"))
        assert array.dtype == np.uint8
        assert array.shape == (len(prompt) + NEW_TOKENS - 1, layers, model.config.num_experts_per_tok)
        expected = hf_router_ids(model, prompt + output.token_ids[:-1])
        np.testing.assert_array_equal(np.sort(array, axis=-1), expected)
