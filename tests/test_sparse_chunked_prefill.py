"""Chunked prefill of the sparse and compressed attention models (DeepSeek-V3.2, GLM-5, DeepSeek-V4) keeps
transformers' greedy tokens when the indexer's scores tie (issue 47).

An indexer's score of a key is sum_h w_h * relu(q_h . k): a key that every head's ReLU zeroes scores exactly 0, so
with few index heads many keys tie, and which tied keys torch.topk keeps depends on the whole row it is given,
its masked (later) entries included. A one-step prefill (transformers' too) scores each prompt token against the
whole prompt; a chunk of a chunked prefill holds only the keys up to its end, so each query's top-k must be taken
over a row as wide as the prompt (`AttentionBatch.index_row_widths`, `lightning_indexer.top_k_over_widths`), else
the chunks pick other tied keys and the tokens change from the first steps on.

The tiny models here run few index heads (4; DeepSeek-V4 one; the other tests' 16 make ties rare on purpose).
The prompts are 44 to 57 tokens, several times index_topk (8; V4's CSA keeps 4 of one entry per 4 tokens) and
longer than every compression block (V4's HCA entry: 16 tokens). Prefills run in chunks of 5 tokens, two prompts at
once; then a prompt sharing the first three KV blocks of one served reads them from the prefix cache and chunks its
tail.
"""
from __future__ import annotations

import pytest

from engine_helpers import greedy
from lazy_engines import engine_pool
from tiny_checkpoints import HFOracle
from moe_runtime import LLM
from moe_runtime.layers.attention_batch import AttentionBatch

FEW_INDEX_HEADS = {   # config overrides of each arch's tiny checkpoint (tests/tiny_archs.py): ties are frequent
    "deepseek_v32": dict(index_n_heads=4, index_head_dim=16),
    "glm_moe_dsa": dict(index_n_heads=4, index_head_dim=16),   # layer 2 a shared layer reusing layer 1's choice
    "deepseek_v4": dict(index_n_heads=1),   # ~14 CSA entries, 4 kept: one head's zeros tie often enough
}
ARCHS = list(FEW_INDEX_HEADS)
NEW_TOKENS = 6
PROMPTS = [
    [(37 * i + 11) % 497 + 3 for i in range(57)],
    [(19 * i + 5) % 491 + 7 for i in range(44)],
]
SHARED_PREFIX = PROMPTS[0][:48] + [(3 * i + 11) % 450 + 8 for i in range(9)]   # three cached blocks of 16
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=5)
LAYOUTS = {
    "chunked_prefix": dict(**CHUNKED, enable_prefix_caching=True),
    "chunked": CHUNKED,
}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory):
    return lambda arch: tiny_checkpoint_factory(arch, **FEW_INDEX_HEADS[arch])


@pytest.fixture(scope="module")
def engines(checkpoints):
    with engine_pool(lambda arch, layout: LLM(str(checkpoints(arch)), device="cpu", dtype="float32",
                                              **LAYOUTS[layout])) as get:
        yield get


@pytest.fixture(scope="module")
def expected(checkpoints):
    """arch -> transformers' greedy tokens of PROMPTS + [SHARED_PREFIX], each arch's oracle run once."""
    found: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in found:
            tokens = HFOracle(checkpoints(arch)).greedy(PROMPTS + [SHARED_PREFIX], NEW_TOKENS)
            assert max(len(set(t)) for t in tokens) > 2, f"{arch}: degenerate oracle tokens"
            found[arch] = tokens
        return found[arch]
    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_with_and_without_a_cached_prefix_keeps_the_tokens(arch, engines, expected):
    """Two prompts prefilled 5 tokens a step (no cached blocks to reuse), then a third sharing the first's
    first 48 tokens: three blocks (latents and index keys, V4's entries and state snapshot) from the prefix
    cache, its tail chunked."""
    llm = engines(arch, "chunked_prefix")
    want = expected(arch)
    hits = llm.engine.stats().prefix_cache_hits
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == want[:2]
    assert llm.engine.stats().prefix_cache_hits == hits, "the first prompts found cached blocks"
    [shared] = llm.generate([SHARED_PREFIX], greedy(NEW_TOKENS))
    assert llm.engine.stats().prefix_cache_hits > hits, "the shared prefix did not reuse its cached blocks"
    assert shared.token_ids == want[2]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_ties_decide_the_tokens(arch, engines, expected, monkeypatch):
    """The case bites: with each chunk's rows only as wide as its context (the prompt widths forgotten, as before
    issue 47), the chunks keep other tied tokens and the continuations differ from transformers'."""
    monkeypatch.setattr(AttentionBatch, "index_row_widths", lambda self, seq: None)
    outputs = engines(arch, "chunked").generate(PROMPTS, greedy(NEW_TOKENS))
    assert [o.token_ids for o in outputs] != expected(arch)[:2], "the prompts test no tied index scores"
