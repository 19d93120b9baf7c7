"""Prefill/decode disaggregation of DeepSeek-V4: the prefill instance parks the prompt's blocks (each compressing
layer's entries, and a CSA layer's index keys, in them) and its state slot (every layer's window keys and carried
compressor projections); the decode instance pulls both, layer by layer in that layer's own frames, and continues.

Greedy tokens of a P/D pair equal transformers' for prompts that end inside a compression window (the carried
partial window must travel), prefilled in 5-token steps; both sides' blocks and slots come back.
"""
from __future__ import annotations

import itertools

import pytest

from lazy_engines import engine_pool
from pd_helpers import decode, free_blocks, prefill, wait_for_blocks_and_slots
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_factory import make_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARCH = "deepseek_v4"
PROMPTS = [   # 45 and 38 tokens: neither ends on a 4- or 16-token window boundary
    [(7 * i + 3) % 500 + 5 for i in range(45)],
    [(5 * i + 2) % 490 + 7 for i in range(38)],
]
NEW_TOKENS = 8
ids = itertools.count()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory, kv_key):
    def build(mode: str, max_num_batched_tokens: int):
        return make_engine(EngineConfig(
            model=str(tiny_checkpoint_factory(ARCH)), device="cpu", dtype="float32", kv_cache_memory=4 * 2**20,
            max_num_seqs=4, disaggregation_mode=mode, kv_transfer_timeout_s=10.0,
            max_num_batched_tokens=max_num_batched_tokens))

    with engine_pool(build) as pooled:
        yield pooled


def test_prefill_there_decode_here_equals_transformers(engines, greedy_oracle):
    """The prefill instance computes each prompt in 5-token steps (its state carried between them before it moves)."""
    want = greedy_oracle(ARCH, PROMPTS, NEW_TOKENS)
    p, d = engines("prefill", 5), engines("decode", 512)
    p_free, d_free = free_blocks(p), free_blocks(d)
    for prompt, tokens in zip(PROMPTS, want):
        first = prefill(p, f"p{next(ids)}", prompt)
        assert first.token_ids == tokens[:1] and first.kv_handle is not None
        [shard] = first.kv_handle.to_json_object()["shards"]
        assert len(shard["compressed_layers"]) == 3 and tuple(shard["state_layers"]) == (0, 1, 2)
        done = decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
        assert (done.finish_reason, done.token_ids) == ("length", tokens)
    wait_for_blocks_and_slots([(p, p_free), (d, d_free)])
