"""The captured decode step's MoE kernel (moe_runtime/kernels/pair_experts.py) against the naive all-experts oracle.

Eager here (the kernel is plain torch; inductor's version of it runs in test_captured_decode.py). fp32:
the same sums in another order, rtol = atol = 1e-5 on outputs O(0.1-1). bf16 weights and activations are
widened to fp32 inside the kernel and the result rounded once: against the fp32 oracle on the same
(bf16-representable) values the only error is that rounding, rtol 8e-3.
"""
import pytest
import torch

from moe_runtime.kernels import reference
from moe_runtime.kernels.pair_experts import pair_expert_mlp

E, H, I, K = 8, 32, 24, 3


def routed_case(num_tokens: int, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=generator).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=generator) / 4).to(dtype)
    w2 = (torch.randn(E, H, I, generator=generator) / 4).to(dtype)
    scores = torch.randn(num_tokens, E, generator=generator).softmax(-1)
    weights, ids = scores.topk(K, dim=-1)                                   # [T, K]
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16])
def test_pair_experts_equal_the_all_experts_oracle(num_tokens):
    x, w13, w2, weights, ids = routed_case(num_tokens, seed=num_tokens)
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    got = pair_expert_mlp(x, ids, weights, w13, w2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_repeated_experts_and_tokens_sharing_them():
    """Every token on the same experts (the pairs of one expert re-read its weights), in different orders."""
    x, w13, w2, weights, _ = routed_case(4)
    ids = torch.tensor([[0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1]])
    torch.testing.assert_close(pair_expert_mlp(x, ids, weights, w13, w2),
                               reference.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_bf16_weights_are_widened_in_the_kernel():
    x, w13, w2, weights, ids = routed_case(6, dtype=torch.bfloat16)
    got = pair_expert_mlp(x, ids, weights, w13, w2)
    assert got.dtype == torch.bfloat16
    expected = reference.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=8e-3)
