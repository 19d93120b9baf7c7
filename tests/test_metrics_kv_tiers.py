"""/metrics' `moe_kv_tier_*` families: every tier's counters by (tier, dp_rank) as the workers report them, after
the trip from the ranks to the front (msgpack: the nested TierCounters come back as TierCounters), and on a real
engine whose prefixes came back from a host tier."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from server_harness import FakeEngine

from engine_helpers import greedy
from moe_runtime import LLM
from moe_runtime.attention_dp.messages import MessageCodec, StepOutputs
from moe_runtime.engine.stats import EngineStats, WorkerStats
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.kv_tiers.block_contents import BlockContents
from moe_runtime.kv_tiers.connector import TierCounters
from moe_runtime.kv_tiers.tier_key import FULL_GROUP
from moe_runtime.server import build_app
from moe_runtime.server.kv_tier_metrics import TIER_FIGURES
from moe_runtime.server.metrics import parse_samples

pytestmark = pytest.mark.timeout(120)

COUNTER_SUFFIX = "_total"


def tiers_of(dp_rank: int) -> list[TierCounters]:
    """A host and a disk tier with distinct numbers per field and worker (so a swapped label shows)."""
    host = TierCounters("host", capacity_bytes=1 << 30, used_bytes=1000 + dp_rank, entries=10 + dp_rank,
                        hits=20 + dp_rank, misses=1, saved=30 + dp_rank, saved_bytes=4000 + dp_rank,
                        loaded_bytes=5000 + dp_rank, save_seconds=0.25, load_seconds=0.5, errors=0)
    disk = TierCounters("disk", capacity_bytes=8 << 30, used_bytes=7000 + dp_rank, entries=70 + dp_rank,
                        hits=2 + dp_rank, misses=3, saved=90 + dp_rank, saved_bytes=9000 + dp_rank,
                        loaded_bytes=600 + dp_rank, save_seconds=1.5, load_seconds=0.75, errors=4)
    return [host, disk]


def over_the_wire(stats: WorkerStats) -> WorkerStats:
    """`stats` as the front receives it from a rank: in a StepOutputs, msgpack-encoded and decoded."""
    codec = MessageCodec()
    message = codec.decode_to_front(codec.encode(StepOutputs(rank=0, dp_rank=stats.dp_rank, deltas=[], stats=stats)))
    return message.stats


class TierFakeEngine(FakeEngine):
    """FakeEngine with two DP workers whose stats carry KV tiers, as the front holds them after the wire."""

    def stats(self) -> EngineStats:
        workers = [over_the_wire(WorkerStats(dp, 0, 0, 100, 100, 0, loading=dp + 1, kv_tier_hit_tokens=64 * (dp + 1),
                                             kv_tiers=tiers_of(dp))) for dp in (0, 1)]
        return EngineStats(workers)


def scrape(engine) -> dict[str, float]:
    async def main():
        async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
        transport = httpx.ASGITransport(app=build_app(async_engine, "fake"))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:
                return parse_samples((await client.get("/metrics")).text)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 60))


def sample_name(figure) -> str:
    return "moe_kv_tier_" + figure.name + (COUNTER_SUFFIX if figure.is_counter else "")


def tier_labels(tier: str, dp_rank: int) -> str:
    """The labels as parse_samples spells them (the exposition's order: alphabetical)."""
    return f'{{dp_rank="{dp_rank}",tier="{tier}"}}'


def test_tier_counters_cross_the_wire_as_tier_counters():
    stats = WorkerStats(1, 0, 0, 10, 10, 0, loading=2, kv_tier_hit_tokens=48, kv_tiers=tiers_of(1))
    received = over_the_wire(stats)
    assert all(type(tier) is TierCounters for tier in received.kv_tiers)
    assert received == stats


def test_every_tier_figure_is_a_family_by_tier_and_dp_rank():
    samples = scrape(TierFakeEngine())
    for dp in (0, 1):
        for tier in tiers_of(dp):
            for figure in TIER_FIGURES:
                key = sample_name(figure) + tier_labels(tier.name, dp)
                assert samples[key] == pytest.approx(figure.read(tier)), key
        assert samples[f'moe_kv_tier_hit_tokens_total{{dp_rank="{dp}"}}'] == 64 * (dp + 1)
        assert samples[f'moe_kv_tier_requests_loading{{dp_rank="{dp}"}}'] == dp + 1
    names = {figure.name for figure in TIER_FIGURES}
    assert {"hits", "misses", "saved_entries", "saved_bytes", "loaded_bytes", "save_seconds", "load_seconds",
            "errors", "used_bytes", "capacity_bytes", "entries"} <= names


def test_a_worker_without_tiers_has_no_tier_samples_and_zero_hit_tokens():
    samples = scrape(FakeEngine())
    assert not [key for key in samples if key.startswith("moe_kv_tier_hits")]
    assert samples['moe_kv_tier_hit_tokens_total{dp_rank="0"}'] == 0
    assert samples['moe_kv_tier_requests_loading{dp_rank="0"}'] == 0


def test_a_real_engine_reports_the_prefixes_its_host_tier_gave_back(tiny_checkpoint_factory):
    """A device pool of 12 blocks of 8: each prompt of 9 blocks evicts the one before, so the second round of the
    same prompts finds every prefix in host memory only."""
    path = str(tiny_checkpoint_factory("llama"))
    common = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=2, max_num_batched_tokens=32)
    probe_budget = 8 << 20
    with LLM(path, kv_cache_memory=probe_budget, **common) as probe:
        core = probe.core
        per_block = BlockContents(core.runner.caches, [], 0).entry_bytes()[FULL_GROUP]
        probe_blocks = core.block_manager.num_blocks
    prompts = [[(7 * i + 31 * j) % 490 + 5 for i in range(9 * 8 + 6)] for j in range(3)]
    llm = LLM(path, kv_cache_memory=probe_budget - (probe_blocks - 12) * per_block, kv_host_memory=16 << 20,
              **common)
    for prompt in prompts + prompts:
        llm.generate([prompt], greedy(2))
    [worker] = llm.engine.stats().workers
    [host] = worker.kv_tiers
    assert host.hits > 0 and worker.kv_tier_hit_tokens > 0
    samples = scrape(llm.engine)   # the AsyncEngine shuts the engine down
    labels = tier_labels("host", 0)
    assert samples["moe_kv_tier_hits_total" + labels] == host.hits
    assert samples["moe_kv_tier_loaded_bytes_total" + labels] == host.loaded_bytes > 0
    assert samples["moe_kv_tier_saved_entries_total" + labels] == host.saved > 0
    assert samples["moe_kv_tier_capacity_bytes" + labels] == 16 << 20
    assert 0 < samples["moe_kv_tier_used_bytes" + labels] <= 16 << 20
    assert samples['moe_kv_tier_hit_tokens_total{dp_rank="0"}'] == worker.kv_tier_hit_tokens
