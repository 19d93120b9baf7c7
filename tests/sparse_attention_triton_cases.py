"""DeepSeek Sparse Attention's Triton kernel (each row over its chosen cache entries) against its torch twin and a
float64 reference, and SparseLatentAttention through the Triton family against the torch family (collected by
test_sparse_attention_triton.py: compiled on CUDA, else in the Triton interpreter in a child process).
"""
import os

import pytest
import torch

from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.index_scores import index_scores as torch_index_scores
from moe_runtime.kernels.sparse_latent_attention import sparse_latent_attention as torch_sparse
from paged_steps import paged_step
from moe_runtime.layers.attention_backend import attention_kernels_for
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.layers.lightning_indexer import IndexerShape, LightningIndexer
from moe_runtime.layers.mla import MLAShape
from moe_runtime.layers.rotary import RotaryEmbedding
from moe_runtime.layers.sparse_mla import SparseLatentAttention

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32, torch.float16]

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("sparse_attention_triton_cases.py runs on CUDA or with TRITON_INTERPRET=1 set before triton "
                       "is imported")

from moe_runtime.kernels.triton_impl.index_scores import index_scores as triton_index_scores  # noqa: E402
from moe_runtime.kernels.triton_impl.sparse_latent_attention import sparse_latent_attention as triton_sparse  # noqa: E402

CASES = [  # rows, heads, entry dim, value dim, chosen per row
    (5, 4, 40, 32, 7),      # heads below a dot tile: the kernel's elementwise path; 40 = 32 + a tail of 8
    (3, 20, 48, 32, 19),    # two head blocks, the second part masked; tl.dot; 48 = 32 + 16
    (4, 16, 24, 16, 33),    # a wider choice than one key tile
]


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}[dtype]


def float64_reference(q, entries, slots, scale, value_dim):
    out = torch.zeros(q.shape[0], q.shape[1], value_dim, dtype=torch.float64)
    for row in range(q.shape[0]):
        chosen = slots[row][slots[row] >= 0].long()
        if chosen.numel() == 0:
            continue
        picked = entries[chosen].double().cpu()                                       # [k, D]
        probs = torch.softmax(q[row].double().cpu() @ picked.T * scale, dim=-1)         # [H, k]
        out[row] = probs @ picked[:, :value_dim]
    return out


def sparse_case(rows, heads, dim, value_dim, width, dtype, seed=0):
    """Random queries and entries; each row's chosen slots scattered over the cache, its tail padded with -1,
    the last row choosing nothing."""
    generator = torch.Generator().manual_seed(seed)
    entries = torch.randn(3 * width + 5, dim, generator=generator)
    q = torch.randn(rows, heads, dim, generator=generator)
    slots = torch.stack([torch.randperm(entries.shape[0], generator=generator)[:width] for _ in range(rows)])
    for row in range(rows):
        slots[row, width - row:] = -1                                                  # row r: r pads
    slots[-1] = -1
    return q.to(DEVICE, dtype), entries.to(DEVICE, dtype), slots.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_sparse_latent_kernel_matches_twin_and_float64(case, dtype):
    rows, heads, dim, value_dim, width = case
    q, entries, slots = sparse_case(rows, heads, dim, value_dim, width, dtype)
    scale = dim ** -0.5
    got = triton_sparse(q, entries, slots, scale, value_dim)
    twin = torch_sparse(q, entries, slots, scale, value_dim)
    torch.testing.assert_close(got.float().cpu(), twin.float().cpu(), **tolerance(dtype))
    want = float64_reference(q, entries, slots.cpu(), scale, value_dim)
    torch.testing.assert_close(got.double().cpu(), want, **tolerance(dtype))
    assert bool((got[-1] == 0).all()), "a row that chose nothing gets zeros"


INDEX_CASES = [  # rows, heads, dim, keys, keys per row (else shared)
    (3, 4, 32, 37, False),     # heads and keys padded to the tiles
    (2, 20, 24, 50, True),     # a captured decode step's rows, each over its own keys
    (5, 16, 128, 16, False),   # DeepSeek-V3.2's index head dim
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_scores_kernel_matches_twin_and_float64(case, dtype):
    rows, heads, dim, num_keys, per_row = case
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(rows, heads, dim, generator=generator).to(DEVICE, dtype)
    weights = torch.randn(rows, heads, generator=generator).to(DEVICE)
    keys = torch.randn(*((rows,) if per_row else ()), num_keys, dim, generator=generator).to(DEVICE, dtype)
    scale = dim ** -0.5
    got = triton_index_scores(queries, weights, keys, scale)
    torch.testing.assert_close(got, torch_index_scores(queries, weights, keys, scale), **tolerance(dtype))
    pattern = "nhd,nsd->nhs" if per_row else "nhd,sd->nhs"
    dot = torch.einsum(pattern, queries.double().cpu(), keys.double().cpu()) * scale
    want = torch.einsum("nh,nhs->ns", weights.double().cpu(), dot.relu())
    torch.testing.assert_close(got.double().cpu(), want, **tolerance(dtype))


def test_sparse_layer_through_the_triton_family_matches_torch():
    """SparseLatentAttention with the Triton family scores and attends through the kernels, the torch family
    through their twins: the same step (a chunk after cached context, a fresh prompt, a decode, all longer than
    the top-k) gives the same outputs."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    shape = MLAShape(hidden_size=32, num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8)
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), 1.0, False)
    index_shape = IndexerShape(hidden_size=32, q_lora_rank=16, num_heads=4, head_dim=16, rope_dim=8, topk=4)
    families = {name: get_kernels("cpu", name) for name in ("torch", "triton")}
    layers = {name: SparseLatentAttention(shape, rotary, 0.3, kernels, torch.float32, selecting_layer=0,
                                          indexer=LightningIndexer(index_shape, rotary, torch.float32, scores=
                                                                   attention_kernels_for(kernels, cpu).index_scores))
              for name, kernels in families.items()}
    for name, param in layers["torch"].named_parameters():
        param.data.normal_(0, 0.3)
        dict(layers["triton"].named_parameters())[name].data.copy_(param.data)
    block_size, num_blocks = 4, 16
    cache = LayerKVCache.allocate(layers["torch"].kv_cache_spec(), num_blocks, block_size, torch.float32, "cpu")
    tables = torch.tensor([[3, 7, 1, 12], [5, 0, -1, -1], [9, 2, 14, -1]], dtype=torch.int32)

    batch, positions = paged_step(tables, block_size, [6, 0, 9], [6, 0, 9])   # earlier step: the cached context
    layers["torch"](positions, torch.randn(15, 32), batch, cache)
    x = torch.randn(13, 32)
    outputs = {}
    for name, layer in layers.items():
        # a fresh batch: a chunk after 6 cached, a fresh prompt, a decode
        batch, positions = paged_step(tables, block_size, [5, 7, 1], [11, 7, 10])
        outputs[name] = layer(positions, x, batch, LayerKVCache(cache.keys.clone(), cache.values.clone()))
    assert layers["triton"]._attention.name == "triton" and layers["torch"]._attention.name == "torch"
    assert layers["triton"].indexer._scores is triton_index_scores
    torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=1e-4, atol=1e-4)
