"""Prefill/decode disaggregation of DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention): the index keys are each
indexer layer's cache's second tensor, in the same blocks as the latents, so the prefill instance's parked blocks
carry them and the decode instance's indexer chooses among the prompt's keys it pulled (GLM-5's shared layer keeps
latents only: its blocks travel as one tensor). Greedy tokens of a P/D pair equal transformers', with equal layouts
and with attention TP 1 -> 2 (the latent and index keys whole on every rank); the blocks come back on both sides.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from lazy_engines import engine_pool
from pd_helpers import decode, free_blocks, prefill, wait_for_free
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.disaggregation.kv_transfer.plan import plan_pulls
from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError, KVShard
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.layers.kv_cache import KVCacheSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARCHS = ["deepseek_v32", "glm_moe_dsa"]
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(40)], [(13 * i + 4) % 470 + 6 for i in range(17)]]
NEW_TOKENS = 6
DECODE_LAYOUTS = [{}, {"ep": 2, "dp_attn": 1}]
ids = itertools.count()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory, kv_key):
    """`engines(arch, mode, **layout)`: one engine per (arch, mode, layout); prompts prefilled in chunks of 16."""
    def build(arch: str, mode: str, layout: tuple):
        return make_engine(EngineConfig(
            model=str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", kv_cache_memory=2 * 2**20,
            max_num_batched_tokens=16, disaggregation_mode=mode, kv_transfer_timeout_s=10.0, **dict(layout)))

    with engine_pool(build) as pooled:
        yield lambda arch, mode, **layout: pooled(arch, mode, tuple(sorted(layout.items())))


@pytest.mark.parametrize("decode_layout", DECODE_LAYOUTS, ids=["D_1rank", "D_attention_tp2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_there_decode_here_equals_transformers(arch, engines, greedy_oracle, decode_layout):
    want = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    p, d = engines(arch, "prefill"), engines(arch, "decode", **decode_layout)
    p_free, d_free = free_blocks(p), free_blocks(d)
    for prompt, tokens in zip(PROMPTS, want):
        first = prefill(p, f"p{next(ids)}", prompt)
        assert first.token_ids == tokens[:1] and first.kv_handle is not None
        done = decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
        assert (done.finish_reason, done.token_ids) == ("length", tokens)
    wait_for_free([(p, p_free), (d, d_free)])




def test_a_shard_names_its_layers_that_keep_keys_only():
    """GLM-5's shape (index keys on layers 0 and 1, none on its shared layer 2): each layer's tensors are known,
    and a prefill instance whose layer keeps other tensors is refused by name before any pull."""
    glm = KVShard.of([KVCacheSpec(1, 40, 32), KVCacheSpec(1, 40, 32), KVCacheSpec(1, 40, None)], 0, 16, torch.float32)
    assert glm.keys_only_layers == (2,) and glm.dims_of(1) == [40, 32] and glm.dims_of(2) == [40]
    every_layer_indexed = KVShard.of([KVCacheSpec(1, 40, 32)] * 3, 0, 16, torch.float32, "tcp://a:1")
    with pytest.raises(KVLayoutError, match=r"layer 2 keeps tensors of \[40, 32\] channels on the prefill"):
        plan_pulls(glm, [every_layer_indexed])
    with pytest.raises(KVLayoutError, match="every layer's cache alike"):
        KVShard.of([KVCacheSpec(1, 40, 32), KVCacheSpec(1, 48, None)], 0, 16, torch.float32)
