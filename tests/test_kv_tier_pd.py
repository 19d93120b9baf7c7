"""KV tiers under prefill/decode disaggregation: a prefill instance with a host tier computes a prompt whose prefix it
evicted earlier from its tier, and the decode instance, pulling the prefill side's blocks as usual, continues with
transformers' greedy tokens: the decode side reads the prefill side's tiers through it."""
from __future__ import annotations

import itertools

import pytest

from pd_helpers import decode, prefill
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from test_kv_tier_engine import HOST, NEW_TOKENS, options_for, prompts_for
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_factory import make_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_decode_instance_continues_a_prompt_the_prefill_instance_loaded_from_its_tier(tiny_checkpoint_factory,
                                                                                         greedy_oracle, kv_key):
    path = tiny_checkpoint_factory("llama")
    options = options_for("llama", path)
    prompts = prompts_for("llama")
    want = greedy_oracle("llama", prompts, NEW_TOKENS)
    ids = itertools.count()
    p = make_engine(EngineConfig(model=str(path), disaggregation_mode="prefill", **options, **HOST))
    d = make_engine(EngineConfig(model=str(path), disaggregation_mode="decode", **options))
    try:
        for prompt, expected in zip(prompts + prompts, want + want):
            first = prefill(p, f"p{next(ids)}", prompt)
            assert first.token_ids == expected[:1] and first.kv_handle is not None
            done = decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
            assert done.token_ids == expected
        [worker] = p.stats().workers
        assert worker.kv_tier_hit_tokens >= len(prompts) * 4 * 8, "the second round's prefixes came from the tier"
    finally:
        p.shutdown()
        d.shutdown()
