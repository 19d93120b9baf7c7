"""RMSNorm against the HF module, paged decode attention against a per-sequence loop and SDPA."""
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from moe_runtime.kernels import NormOutput, get_kernels

FAMILIES = ["torch", "reference"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 7])
def test_rms_norm_matches_hf(family, dtype, tokens):
    torch.manual_seed(0)
    module = Qwen3MoeRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.normal_()
        x = torch.randn(tokens, 48).to(dtype)
        residual = torch.randn(tokens, 48).to(dtype)
        expected = module(x)
        expected_fused = module(x + residual)
    kernels = get_kernels("cpu", family)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.rms_norm(x, module.weight, 1e-6), expected, **tol)
    fused = kernels.fused_add_rms_norm(x, residual, module.weight, 1e-6)
    assert isinstance(fused, NormOutput)
    torch.testing.assert_close(fused.out, expected_fused, **tol)
    torch.testing.assert_close(fused.residual, x + residual, rtol=0, atol=0)


def make_paged_cache(context_lens, num_kv_heads, head_dim, v_dim, block_size, seed=0, shared_kv=False):
    """Scatter random K/V for each sequence into shuffled cache blocks; return contiguous copies too."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_needed) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = k_cache[..., :v_dim] if shared_kv else torch.randn(num_blocks, block_size, num_kv_heads, v_dim,
                                                                 generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_needed + [1]) + 1
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    for seq, need in enumerate(blocks_needed):
        tables[seq, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
    return k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def sdpa_oracle(q, k_cache, v_cache, tables, context_lens, scale):
    """Independent oracle: gather each sequence contiguously and run torch SDPA with GQA expansion."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    outs = []
    for seq in range(q.shape[0]):
        length = int(context_lens[seq])
        if length == 0:
            outs.append(torch.zeros(q.shape[1], v_cache.shape[3]))
            continue
        keys = k_cache[tables[seq].long()].reshape(-1, num_kv_heads, k_cache.shape[3])[:length]
        values = v_cache[tables[seq].long()].reshape(-1, num_kv_heads, v_cache.shape[3])[:length]
        group = q.shape[1] // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)      # [Hq, L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, Dv]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[seq].float()[:, None], keys.float(), values.float(), scale=scale)[:, 0])
    return torch.stack(outs) if outs else torch.zeros(0, q.shape[1], v_cache.shape[3])


ATTENTION_CASES = {
    "gqa": dict(context_lens=[1, 5, 16, 17], q_heads=4, kv_heads=2, head_dim=8, v_dim=8, block_size=4),
    "mqa": dict(context_lens=[9, 3], q_heads=4, kv_heads=1, head_dim=16, v_dim=16, block_size=8),
    "mha_with_empty_sequence": dict(context_lens=[0, 6], q_heads=2, kv_heads=2, head_dim=8, v_dim=8, block_size=4),
    "mla_shared_cache": dict(context_lens=[7, 12, 2], q_heads=4, kv_heads=1, head_dim=24, v_dim=16, block_size=4,
                             shared_kv=True),
    "empty_batch": dict(context_lens=[], q_heads=2, kv_heads=1, head_dim=8, v_dim=8, block_size=4),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_decode_attention(family, case):
    spec = dict(ATTENTION_CASES[case])
    q_heads = spec.pop("q_heads")
    k_cache, v_cache, tables, lens = make_paged_cache(
        spec["context_lens"], spec["kv_heads"], spec["head_dim"], spec["v_dim"], spec["block_size"],
        shared_kv=spec.get("shared_kv", False))
    q = torch.randn(len(spec["context_lens"]), q_heads, spec["head_dim"])
    scale = spec["head_dim"] ** -0.5
    got = get_kernels("cpu", family).paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert got.shape == (q.shape[0], q_heads, spec["v_dim"])
    torch.testing.assert_close(got, sdpa_oracle(q, k_cache, v_cache, tables, lens, scale), rtol=0, atol=1e-5)


def test_paged_attention_rejects_bad_heads():
    k_cache, v_cache, tables, lens = make_paged_cache([3], 3, 8, 8, 4)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        get_kernels("cpu", "torch").paged_decode_attention(torch.randn(1, 4, 8), k_cache, v_cache, tables, lens, 1.0)
