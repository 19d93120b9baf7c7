"""Prefill/decode disaggregation of DeepSeek-V3.2 (DeepSeek Sparse Attention): the index keys are each layer's
cache's second tensor, in the same blocks as the latents, so the prefill instance's parked blocks carry them and
the decode instance's indexer chooses among the prompt's keys it pulled. Greedy tokens of a P/D pair equal
transformers', with equal layouts and with attention TP 1 -> 2 (the latent and index keys whole on every rank);
the blocks come back on both sides. GLM-5's shared layers keep no index keys, so its layers' caches differ, which
a transfer refuses by name at start-up.
"""
from __future__ import annotations

import itertools

import pytest

from lazy_engines import engine_pool
from pd_helpers import decode, free_blocks, prefill, wait_for_free
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError
from moe_runtime.engine.core import EngineCore
from moe_runtime.front.engine_factory import make_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARCH = "deepseek_v32"
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(40)], [(13 * i + 4) % 470 + 6 for i in range(17)]]
NEW_TOKENS = 6
DECODE_LAYOUTS = [{}, {"ep": 2, "dp_attn": 1}]
ids = itertools.count()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory, kv_key):
    """`engines(mode, **layout)`: one DeepSeek-V3.2 engine per (mode, layout); prompts prefilled in chunks of 16."""
    def build(mode: str, layout: tuple):
        return make_engine(EngineConfig(
            model=str(tiny_checkpoint_factory(ARCH)), device="cpu", dtype="float32", kv_cache_memory=2 * 2**20,
            max_num_batched_tokens=16, disaggregation_mode=mode, kv_transfer_timeout_s=10.0, **dict(layout)))

    with engine_pool(build) as pooled:
        yield lambda mode, **layout: pooled(mode, tuple(sorted(layout.items())))


@pytest.mark.parametrize("decode_layout", DECODE_LAYOUTS, ids=["D_1rank", "D_attention_tp2"])
def test_prefill_there_decode_here_equals_transformers(engines, greedy_oracle, decode_layout):
    want = greedy_oracle(ARCH, PROMPTS, NEW_TOKENS)
    p, d = engines("prefill"), engines("decode", **decode_layout)
    p_free, d_free = free_blocks(p), free_blocks(d)
    for prompt, tokens in zip(PROMPTS, want):
        first = prefill(p, f"p{next(ids)}", prompt)
        assert first.token_ids == tokens[:1] and first.kv_handle is not None
        done = decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
        assert (done.finish_reason, done.token_ids) == ("length", tokens)
    wait_for_free([(p, p_free), (d, d_free)])


def test_a_model_whose_layers_keep_different_caches_is_refused_by_name(tiny_checkpoint_factory, kv_key):
    with pytest.raises(KVLayoutError, match="every layer's cache alike"):
        EngineCore(EngineConfig(model=str(tiny_checkpoint_factory("glm_moe_dsa")), device="cpu", dtype="float32",
                                disaggregation_mode="prefill"))
