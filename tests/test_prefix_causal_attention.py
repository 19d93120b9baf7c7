"""A chunk's causal attention over its cached prefix, as two softmaxes merged by log-sum-exp, against one masked
softmax over all keys."""
import pytest
import torch
import torch.nn.functional as F

from moe_runtime.kernels.prefix_causal_attention import merge_attention_states, prefix_causal_attention


def masked_reference(q, k, v, scale):   # [1, Hq, n, D], [1, Hkv, S, D], [1, Hkv, S, Dv]
    n, total = q.shape[2], k.shape[2]
    allowed = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double()).float()


@pytest.mark.parametrize("hq, hkv, d, dv, n, prefix", [
    (8, 4, 16, 16, 5, 9),       # GQA
    (4, 4, 24, 16, 7, 1),       # MHA, value dim != key dim (MLA's expanded heads), one prefix key
    (8, 1, 32, 32, 1, 40),      # MQA, a single query (a one-token piece of a long prompt)
    (2, 2, 8, 12, 6, 10),       # value dim > key dim
    (2, 2, 8, 8, 33, 0),        # no prefix: plain causal
    (8, 2, 64, 64, 130, 300),   # longer than the flash kernel's blocks
])
def test_merged_softmax_equals_one_masked_softmax(hq, hkv, d, dv, n, prefix):
    gen = torch.Generator().manual_seed(n + prefix)
    q = torch.randn(1, hq, n, d, generator=gen)
    k = torch.randn(1, hkv, prefix + n, d, generator=gen)
    v = torch.randn(1, hkv, prefix + n, dv, generator=gen)
    torch.testing.assert_close(prefix_causal_attention(q, k, v, 0.3), masked_reference(q, k, v, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_bfloat16_within_rounding():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, m, 32, generator=gen) for m in (16, 80, 80))
    got = prefix_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), masked_reference(q, k, v, 0.2), rtol=2e-2, atol=2e-2)


def test_merge_weights_each_part_by_its_share_of_the_total():
    # one query, two keys split into two "sets": the merge must give softmax over both
    scores = torch.tensor([1.5, -0.5])
    values = torch.tensor([[2.0], [10.0]])
    out = merge_attention_states(values[0].view(1, 1, 1, 1), scores[0].view(1, 1, 1),
                                 values[1].view(1, 1, 1, 1), scores[1].view(1, 1, 1))
    expected = (scores.softmax(0)[:, None] * values).sum(0)
    torch.testing.assert_close(out.view(1), expected)
    assert F.softmax(scores, 0)[0] > 0.8    # the first part dominates: a merge that averaged would fail
