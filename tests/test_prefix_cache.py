"""Prefix caching: content-addressed KV blocks, reference counts, LRU eviction, reuse at admission.

- bookkeeping (no model): the hash chain is the same in every process; a request reuses its longest
  cached prefix but always computes its last token; shared blocks are counted; idle blocks are
  evicted least recently used first, tails before prefixes, and only when memory is needed; the
  changes a worker reports are their net effect;
- the engine (tiny llama, engines shared by the module): greedy tokens are the same with and without
  caching, and every scenario (finish, abort mid-prefill, abort mid-decode, preemption, a failed
  request, a reset) leaves every block free or idle-cached with no reference held; prompt-logprob
  requests read nothing from the cache and still score their whole prompt;
- the server: hits in /metrics, POST /reset_prefix_cache behind the API key.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_harness import FakeEngine, serve_in_process

from engine_helpers import greedy
from tiny_checkpoints import HFOracle
from moe_runtime import LLM, SamplingParams
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.engine.stats import EngineStats, WorkerStats
from moe_runtime.kv_blocks.prefix_cache import PrefixCache
from moe_runtime.kv_blocks.prefix_hash import block_hashes
from moe_runtime.sampling.sampler import Sampler
from moe_runtime.engine.scheduler import Scheduler, SchedulerConfig
from moe_runtime.records.sequence import Sequence

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
SYSTEM = [(13 * i + 7) % 480 + 20 for i in range(40)]        # a shared "system prompt" of 10 llama blocks (bs 4)
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + [9, 10, 11, 12, 13], SYSTEM[:17], [300, 301, 302]]
POISON = [9, 8, 7, 6]


def fresh_prompt(seed: int, length: int = 43) -> list[int]:
    """A prompt no other test of this module sends (nothing of it is cached)."""
    return [(17 * i + 31 * seed) % 480 + 20 for i in range(length)]


def seq(tokens: list[int], request_id: str = "r", **params) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=4, **params), arrival=0)


def assert_no_block_held(manager: BlockManager) -> None:
    """Every block is free or idle-cached, none referenced: nothing leaked."""
    assert manager.num_free_blocks == manager.num_blocks
    assert all(count == 0 for count in manager.pool._refs)


# ---- bookkeeping -----------------------------------------------------------------------------------------
def test_block_hashes_chain_the_prefix_and_are_the_same_in_another_process():
    tokens = list(range(100, 113))
    hashes = block_hashes(tokens, BLOCK)
    assert len(hashes) == 3, "only full blocks are hashed"
    assert block_hashes([1] + tokens[1:], BLOCK)[1:] != hashes[1:], "a block's hash depends on its prefix"
    code = f"from moe_runtime.kv_blocks.prefix_hash import block_hashes; print(block_hashes({tokens!r}, {BLOCK}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="12345"), cwd=Path(__file__).resolve().parents[1])
    assert other.stdout.strip() == str(hashes)


def test_admission_reuses_the_longest_cached_prefix_but_computes_the_last_token():
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    first = seq(list(range(12)))                        # exactly three blocks
    assert manager.admit(first)
    assert first.num_cached_tokens == 0
    manager.cache_full_blocks(first, 12)
    again = seq(list(range(12)), "again")               # the same prompt: all but its last block reused
    assert manager.admit(again)
    assert again.num_cached_tokens == 8 and again.kv.block_table[:2] == first.kv.block_table[:2]
    assert again.kv.block_table[2] != first.kv.block_table[2], "the block with the last token is computed again"
    longer = seq(list(range(10)) + [99, 98, 97], "longer")   # shares two blocks, then differs
    assert manager.admit(longer)
    assert longer.num_cached_tokens == 8
    assert manager.pool._refs[first.kv.block_table[0]] == 3
    assert manager.counters.queries == 12 + 12 + 13 and manager.counters.hits == 8 + 8
    for s in (first, again, longer):
        manager.free(s)
    assert_no_block_held(manager)
    assert manager.prefix_cache.num_idle == 3, "freed blocks stay cached until memory is needed"


def test_idle_blocks_are_evicted_least_recently_used_and_tails_first_only_when_memory_is_needed():
    manager = BlockManager(6, BLOCK, enable_prefix_caching=True)
    a, b = seq(list(range(12)), "a"), seq(list(range(50, 62)), "b")
    for s in (a, b):
        assert manager.admit(s)
        manager.cache_full_blocks(s, 12)
    manager.free(a)                                     # a's blocks idle first (least recently used)
    manager.free(b)
    assert manager.num_free_blocks == 6 and manager.prefix_cache.num_idle == 6
    manager.take_cache_events()
    c = seq(list(range(200, 204)), "c")                 # one block needed: evicts a's tail, nothing else
    assert manager.admit(c)
    events = manager.take_cache_events()
    assert events.evicted == [block_hashes(a.prompt_token_ids, BLOCK)[2]] and not events.stored
    reuse = seq(list(range(12)) + [1], "a-again")       # a's first two blocks are still there
    assert manager.admit(reuse) and reuse.num_cached_tokens == 8
    manager.free(c)
    manager.free(reuse)
    assert_no_block_held(manager)


def test_a_shared_block_is_not_evictable_while_referenced():
    manager = BlockManager(3, BLOCK, enable_prefix_caching=True)
    a = seq(list(range(8)), "a")
    assert manager.admit(a)
    manager.cache_full_blocks(a, 8)
    b = seq(list(range(4)) + [70, 71, 72, 73, 74], "b")   # reuses a's first block, needs two more: one free left
    assert not manager.admit(b), "only one block is free: b must wait"
    assert b.kv.block_table == [] and manager.pool._refs[a.kv.block_table[0]] == 1, "a refused admission changes nothing"
    manager.free(a)
    assert manager.admit(b) and b.num_cached_tokens == 4
    manager.free(b)
    assert_no_block_held(manager)


def test_cache_events_are_the_net_change_and_a_reset_clears_everything():
    cache = PrefixCache()
    cache.store(0, 111)
    cache.park(0)
    assert cache.evict_lru() == (0, 111), "the block and the hash it held (which a KV tier keeps)"
    cache.store(1, 222)
    events = cache.take_events()
    assert events.stored == [222] and events.evicted == [111] and not events.cleared
    assert cache.reset() == [] and cache.num_cached == 0
    cache.store(2, 333)
    events = cache.take_events()
    assert events.cleared and events.stored == [333] and not cache.take_events()


def test_a_request_scoring_its_prompt_reads_nothing_from_the_cache():
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager)
    warm = seq(list(range(12)), "warm")
    scheduler.add(warm)
    scheduler.schedule()                                # registers its blocks as it schedules them
    scored = seq(list(range(12)), "scored", prompt_logprobs=1)
    plain = seq(list(range(12)), "plain")
    scheduler.add(scored)
    scheduler.add(plain)
    batch = scheduler.schedule()
    assert batch is not None and [s.request_id for s in batch.seqs] == ["scored", "plain"]
    assert scored.num_cached_tokens == 0 and scored.num_scheduled_tokens == 12
    assert plain.num_cached_tokens == 8 and plain.num_scheduled_tokens == 4


def test_a_request_reuses_blocks_an_earlier_request_of_the_same_step_computes():
    manager = BlockManager(32, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=True), manager)
    first, second = seq(list(range(30)), "first"), seq(list(range(30)), "second")
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second]
    assert second.num_cached_tokens == 28 and second.kv.block_table[:7] == first.kv.block_table[:7], \
        "a step writes every token's K/V before any attention read, so the later request reads them"


# ---- the engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_path(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="module")
def oracle(llama_path):
    return HFOracle(llama_path)


@pytest.fixture(scope="module")
def cached(llama_path):
    """Prefix caching and chunked prefill (budget 16: SYSTEM takes three steps), block size 4."""
    with LLM(str(llama_path), device="cpu", dtype="float32", block_size=BLOCK, enable_prefix_caching=True,
             enable_chunked_prefill=True, max_num_batched_tokens=16) as llm:
        yield llm


def manager_of(llm) -> BlockManager:
    return llm.core.block_manager


def test_greedy_tokens_are_the_same_with_and_without_cached_prefixes(cached, oracle):
    expected = oracle.greedy(PROMPTS, 6)
    before = cached.engine.stats()
    cold = cached.generate(PROMPTS, greedy(6))
    between = cached.engine.stats()
    warm = cached.generate(PROMPTS, greedy(6))
    after = cached.engine.stats()
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert between.prefix_cache_hits - before.prefix_cache_hits >= 40, "the cold pass shares SYSTEM in flight"
    # every full block but the one with the last token: 10 + 11 + 4 blocks of 4 tokens
    assert after.prefix_cache_hits - between.prefix_cache_hits == 4 * (10 + 11 + 4)
    assert after.prefix_cache_queries - between.prefix_cache_queries == sum(len(p) for p in PROMPTS)
    assert_no_block_held(manager_of(cached))


def test_aborts_mid_prefill_and_mid_decode_leave_no_block_held(cached):
    engine = cached.engine
    engine.add_request("mid-prefill", fresh_prompt(1), greedy(8))
    engine.step()                                       # 16 of its 43 tokens: still prefilling
    core_seq = engine.core.scheduler.running[0]
    assert 0 < core_seq.num_cached_tokens < core_seq.num_tokens
    engine.abort("mid-prefill")
    assert_no_block_held(manager_of(cached))
    engine.add_request("mid-decode", fresh_prompt(2), greedy(8))
    while not engine.core.scheduler.running or not engine.core.scheduler.running[0].output_token_ids:
        engine.step()
    engine.abort("mid-decode")
    assert not engine.has_unfinished()
    assert_no_block_held(manager_of(cached))


def test_a_failed_request_leaves_no_block_held_and_the_others_their_tokens(cached, oracle, monkeypatch):
    class PoisonedSampler:
        def __init__(self, inner: Sampler):
            self.inner = inner

        def __call__(self, logits, seqs):
            if any(s.prompt_token_ids == SYSTEM + POISON for s in seqs):
                raise RuntimeError("injected sampling failure")
            return self.inner(logits, seqs)

    monkeypatch.setattr(cached.core, "sampler", PoisonedSampler(cached.core.sampler))
    healthy, poisoned = cached.generate([PROMPTS[0], SYSTEM + POISON], greedy(4))
    assert poisoned.finish_reason == "error" and healthy.token_ids == oracle.greedy([PROMPTS[0]], 4)[0]
    assert_no_block_held(manager_of(cached))


def test_reset_forgets_idle_blocks_and_unshares_the_ones_in_use(cached):
    cached.generate([PROMPTS[0]], greedy(2))
    manager = manager_of(cached)
    assert manager.prefix_cache.num_idle > 0
    engine = cached.engine
    engine.add_request("running", PROMPTS[1], greedy(4))
    engine.step()
    engine.reset_prefix_cache()
    assert manager.prefix_cache.num_cached == 0 and manager.prefix_cache.num_idle == 0
    while engine.has_unfinished():
        engine.step()
    assert_no_block_held(manager)
    before = engine.stats().prefix_cache_hits
    cached.generate([PROMPTS[0]], greedy(2))
    assert engine.stats().prefix_cache_hits == before, "nothing is cached after a reset"


def test_prompt_logprobs_with_caching_score_the_whole_prompt(cached, oracle):
    cached.generate([PROMPTS[1]], greedy(2))           # SYSTEM is cached now
    before = cached.engine.stats().prefix_cache_hits
    [scored] = cached.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    assert cached.engine.stats().prefix_cache_hits == before, "a prompt-logprob request read the cache"
    expected = oracle.prefill_logits(PROMPTS[1])[:-1].log_softmax(dim=-1)          # [P-1, V]
    entries = scored.prompt_logprobs
    assert len(entries) == len(PROMPTS[1]) and entries[0] is None
    got = torch.tensor([e.logprob for e in entries[1:]])
    want = expected.gather(1, torch.tensor(PROMPTS[1][1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_no_block_held(manager_of(cached))


def test_preemption_with_cached_prefixes_keeps_tokens_and_leaks_nothing(llama_path, oracle):
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(1, 5)]
    expected = oracle.greedy(prompts, 24)
    # 24 blocks of 4 tokens: SYSTEM (10 blocks) shared, each request needs 7 more: four do not fit at once
    probe_bytes = 24 * BLOCK * 2 * 2 * 4 * 16 * 4    # layers * (k, v) * kv_heads * head_dim * fp32 per token
    with LLM(str(llama_path), device="cpu", dtype="float32", block_size=BLOCK, kv_cache_memory=probe_bytes,
             enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32) as llm:
        manager = manager_of(llm)
        assert manager.num_blocks == 24
        outputs = llm.generate(prompts, greedy(24))
        assert llm.core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert_no_block_held(manager)
        assert llm.engine.stats().prefix_cache_hits > 0
    assert [o.token_ids for o in outputs] == expected


# ---- the server ------------------------------------------------------------------------------------------
class CachingFakeEngine(FakeEngine):
    def __init__(self):
        super().__init__()
        self.resets = 0

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def stats(self) -> EngineStats:
        return EngineStats([WorkerStats(0, 0, 0, 100, 100, 0, prefix_cache_queries=300, prefix_cache_hits=120),
                            WorkerStats(1, 0, 0, 100, 100, 0, prefix_cache_queries=100, prefix_cache_hits=80)])


def test_metrics_report_prefix_cache_tokens_and_reset_needs_the_api_key():
    engine = CachingFakeEngine()

    async def scenario(client, _):
        refused = await client.post("/reset_prefix_cache")
        accepted = await client.post("/reset_prefix_cache", headers={"Authorization": "Bearer secret"})
        text = (await client.get("/metrics")).text
        return refused.status_code, accepted.status_code, text

    refused, accepted, text = serve_in_process(engine, scenario, api_key="secret")
    assert (refused, accepted, engine.resets) == (401, 200, 1)
    samples = {(s.name, s.labels.get("dp_rank")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("moe_prefix_cache_queries_total", "0")] == 300
    assert samples[("moe_prefix_cache_hits_total", "1")] == 80
