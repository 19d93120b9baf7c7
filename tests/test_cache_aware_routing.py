"""Cache-aware DP routing: the front sends a request to the DP worker holding its prefix unless that
worker's extra load outweighs the prefill it saves; its index of who holds what follows the workers'
reports (stored, evicted, cleared) and stays bounded.

The last tests run a real expert-parallel engine (deepseek_v3, MLA, ep=2 with two DP attention
workers; one engine for the module): chunked prefill and prefix caching give transformers' greedy
tokens there, requests sharing a prefix follow it, and a reset empties the index.
"""
from __future__ import annotations

import pytest

from engine_helpers import PROMPTS, greedy
from tiny_checkpoints import hf_greedy
from moe_runtime.attention_dp.messages import MessageCodec, ResetPrefixCache, StepOutputs
from moe_runtime.attention_dp.prefix_index import PrefixCacheIndex
from moe_runtime.attention_dp.router import DPRouter
from moe_runtime import LLM
from moe_runtime.engine.stats import WorkerStats
from moe_runtime.kv_blocks.prefix_cache import PrefixCacheEvents
from moe_runtime.kv_blocks.prefix_hash import block_hashes

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
SYSTEM_A = [(13 * i + 7) % 480 + 20 for i in range(32)]
SYSTEM_B = [(29 * i + 11) % 480 + 20 for i in range(32)]


# ---- the index and the router (no engine) ----------------------------------------------------------------
def test_the_index_follows_stored_evicted_and_cleared_blocks_and_expected_ones_until_settled():
    index = PrefixCacheIndex(2)
    hashes = block_hashes(SYSTEM_A, BLOCK)                                  # 8 blocks
    index.apply(0, PrefixCacheEvents(stored=hashes[:5]))
    assert index.cached_blocks(0, hashes) == 5 and index.cached_blocks(1, hashes) == 0
    index.apply(0, PrefixCacheEvents(evicted=[hashes[3]]))
    assert index.cached_blocks(0, hashes) == 3, "a prefix stops at the first block the worker evicted"
    index.expect("r", 1, hashes)
    assert index.cached_blocks(1, hashes) == 8, "a request routed there will leave its blocks"
    index.settle("r")
    assert index.cached_blocks(1, hashes) == 0 and index.num_expected_requests == 0
    index.apply(0, PrefixCacheEvents(stored=[hashes[3]], cleared=True))
    assert index.num_held(0) == 1 and index.cached_blocks(0, hashes) == 0


def test_a_request_follows_its_cached_prefix_until_that_worker_is_a_prompt_behind():
    router = DPRouter.for_workers(2, 100, cache_aware=True, block_size=BLOCK)
    prompt = SYSTEM_A + [1, 2, 3]                                           # 35 tokens, 8 full blocks
    router.prefix_index.apply(1, PrefixCacheEvents(stored=block_hashes(SYSTEM_A, BLOCK)))
    router.loads[1].tokens = 60            # expected work 60 + 3 vs 0 + 35: behind, but by less than 35
    decision = router.choose("a", len(prompt), block_hashes(prompt, BLOCK))
    assert decision.dp_rank == 1 and decision.cached_tokens == [0, 32]
    assert router.loads[1].tokens == 63, "only the uncached part counts as new work there"
    router.loads[1].tokens = 100           # 103 vs 35: more than a prompt behind
    assert router.choose("b", len(prompt), block_hashes(prompt, BLOCK)).dp_rank == 0
    plain = DPRouter.for_workers(2, 100)
    plain.loads[1].tokens = 20
    assert plain.choose("c", len(prompt), block_hashes(prompt, BLOCK)).dp_rank == 0, "least load without an index"


def test_a_burst_sharing_a_prefix_follows_the_first_request_before_any_report():
    router = DPRouter.for_workers(2, 100, cache_aware=True, block_size=BLOCK)
    first, second = SYSTEM_A + [1, 2], SYSTEM_A + [3, 4]
    other = SYSTEM_B + [5]
    assert router.choose("first", len(first), block_hashes(first, BLOCK)).dp_rank == 0
    assert router.choose("other", len(other), block_hashes(other, BLOCK)).dp_rank == 1
    assert router.choose("second", len(second), block_hashes(second, BLOCK)).dp_rank == 0
    for request_id in ("first", "other", "second"):
        router.release(request_id)
    assert router.prefix_index.num_expected_requests == 0, "expected blocks end with their requests"


def test_cache_events_and_the_reset_cross_the_control_plane():
    codec = MessageCodec()
    events = PrefixCacheEvents(stored=[2**63 - 1, 5], evicted=[7], cleared=True)
    sent = StepOutputs(rank=1, dp_rank=1, deltas=[], stats=WorkerStats(1, 0, 0, 8, 8, 0, prefix_cache_hits=3),
                       cache_events=events)
    received = codec.decode_to_front(codec.encode(sent))
    assert received.cache_events == events and received.stats.prefix_cache_hits == 3
    assert isinstance(codec.decode_to_rank(codec.encode(ResetPrefixCache())), ResetPrefixCache)


# ---- a real expert-parallel engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_path(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("deepseek_v3")


@pytest.fixture(scope="module")
def ep_engine(deepseek_path):
    with LLM(str(deepseek_path), device="cpu", dtype="float32", ep=2, dp_attn=2, block_size=BLOCK,
             enable_chunked_prefill=True, max_num_batched_tokens=7, enable_prefix_caching=True) as llm:
        yield llm


def settle_reports(llm: LLM) -> None:
    """One tiny request on each DP worker (least load splits them), generated to its end: each worker's
    earlier reports (a reset) reached the front before that request's output, on the same socket."""
    llm.generate([[7, 8], [9, 10]], greedy(1))       # no full block: caches nothing


def add_together(llm: LLM, requests: dict[str, list[int]]) -> dict[str, int]:
    """Add the requests one after the other, then run them to their end; the DP worker each was sent to."""
    chosen = {}
    for request_id, prompt in requests.items():
        llm.engine.add_request(request_id, prompt, greedy(2))
        chosen[request_id] = llm.engine.router.last_decision.dp_rank
    while llm.engine.has_unfinished():
        llm.engine.step()
    return chosen


def test_expert_parallel_chunked_prefill_with_cached_prefixes_gives_transformers_tokens(ep_engine, deepseek_path):
    prompts = [SYSTEM_A + [1, 2, 3], SYSTEM_A + [4, 5], PROMPTS[1], PROMPTS[2], SYSTEM_B + [6]]
    expected = hf_greedy(deepseek_path, prompts, 5)
    cold = ep_engine.generate(prompts, greedy(5))
    warm = ep_engine.generate(prompts, greedy(5))
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    stats = ep_engine.engine.stats()
    assert all(w.prefix_cache_hits > 0 for w in stats.workers)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers), "blocks leaked"


def test_requests_sharing_a_prefix_follow_it_and_a_reset_empties_the_index(ep_engine):
    engine = ep_engine.engine
    engine.reset_prefix_cache()
    settle_reports(ep_engine)
    index = engine.router.prefix_index
    assert index.num_held(0) == 0 and index.num_held(1) == 0
    first = add_together(ep_engine, {"a1": SYSTEM_A + [1], "b1": SYSTEM_B + [2]})   # least load splits them
    owner_a, owner_b = first["a1"], first["b1"]
    assert owner_a != owner_b
    assert index.num_held(owner_a) >= 8 and index.num_held(owner_b) >= 8, "each worker reported its blocks"
    # both idle again: least load alone would send the first of these to worker 0 whatever it asks for
    second = add_together(ep_engine, {"b2": SYSTEM_B + [3, 4], "a2": SYSTEM_A + [5, 6]})
    assert second == {"b2": owner_b, "a2": owner_a}
    assert engine.router.last_decision.cached_tokens[owner_a] == 32
    engine.reset_prefix_cache()
    settle_reports(ep_engine)
    assert index.num_held(0) == 0 and index.num_held(1) == 0
