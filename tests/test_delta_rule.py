"""The gated delta rule's torch twins (moe_runtime/kernels/delta_rule.py) against the float64 token-by-token reference:
chunked over several chunks (a ragged last one) from a nonzero state, split across calls (chunked prefill
carries the state), and the batched one-token step. fla-core's CUDA twins (moe_runtime/kernels/delta_rule_fla.py) are the
GPU check's: this machine has no CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_runtime.kernels.delta_rule import chunked_delta_rule, delta_rule_step
from moe_runtime.kernels.delta_rule_fla import fla_available
from moe_runtime.kernels.delta_rule_reference import reference_delta_rule


def _inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(length, heads, generator=gen))          # log decay <= 0
    beta = torch.sigmoid(torch.randn(length, heads, generator=gen))
    state = torch.randn(heads, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (37, 16), (64, 16)])
def test_chunked_matches_the_float64_reference(length, chunk):
    q, k, v, g, beta, state = _inputs(length)
    out, final = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    ref_out, ref_final = reference_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, atol=2e-5, rtol=1e-5)


def test_a_prefill_split_across_calls_carries_the_state():
    q, k, v, g, beta, state = _inputs(30, seed=1)
    first, mid = chunked_delta_rule(q[:11], k[:11], v[:11], g[:11], beta[:11], state, chunk=4)
    second, final = chunked_delta_rule(q[11:], k[11:], v[11:], g[11:], beta[11:], mid, chunk=4)
    ref_out, ref_final = reference_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(torch.cat([first, second]).double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, atol=2e-5, rtol=1e-5)


def test_one_step_for_a_batch_matches_the_reference():
    batch = [_inputs(1, seed=s) for s in range(4)]
    stacked = [torch.stack([b[i][0] for b in batch]) for i in range(5)]       # [B, H, ...]
    states = torch.stack([b[5] for b in batch])                                # [B, H, Dk, Dv]
    out, new = delta_rule_step(*stacked, states)
    for index, (q, k, v, g, beta, state) in enumerate(batch):
        ref_out, ref_state = reference_delta_rule(q, k, v, g, beta, state)
        torch.testing.assert_close(out[index].double(), ref_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new[index].double(), ref_state, atol=1e-5, rtol=1e-5)


def test_fla_is_not_chosen_without_cuda():
    assert not fla_available(torch.device("cpu"))
