"""The scheduler and the tiers' step around it, without a model: a request back from the tiers never waits behind a
queue that cannot move, and one that also resumes a device snapshot gets it copied into its slot before another
request's capture reuses the row (both found by review, kept here as the scenarios that showed them)."""
from __future__ import annotations

import torch

from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.kv_blocks.prefix_hash import block_hashes
from moe_runtime.engine.scheduler import Scheduler, SchedulerConfig
from moe_runtime.records.sequence import FinishReason, Sequence
from moe_runtime.kv_tiers.block_contents import BlockContents
from moe_runtime.kv_tiers.engine_tiers import EngineTiers
from moe_runtime.kv_tiers.entry_sizes import EntrySizes
from moe_runtime.kv_tiers.host_tier import HostTier
from moe_runtime.kv_tiers.tier_key import FULL_GROUP, TierKey
from moe_runtime.engine.tier_steps import TierSteps
from moe_runtime.kv_tiers.tiered_store import TieredStore
from moe_runtime.kv_tiers.worker_agreement import WorkerAgreement
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.layers.state_cache import LayerStateCache, StateSpec
from moe_runtime.sampling.params import SamplingParams

BS = 4


class HeldKeys:
    def __init__(self, keys):
        self.keys = set(keys)

    def holds(self, key) -> bool:
        return key in self.keys


def compute(scheduler: Scheduler, batch) -> None:
    """What a step does to its sequences (no model): the scheduled tokens are cached, a finished prompt samples, a
    request at its max_tokens finishes."""
    for seq in batch.seqs:
        seq.commit_scheduled_tokens()
        if seq.num_cached_tokens >= seq.num_tokens:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)


def test_a_request_back_from_the_tiers_is_not_stuck_behind_a_request_that_cannot_fit():
    """R decodes and needs blocks; L comes back from the tiers holding most of the pool. Before the fix L waited in the
    queue behind R's preempted self, holding its blocks, and nothing ever ran again."""
    manager = BlockManager(11, BS, enable_prefix_caching=True)
    loaded_prompt = list(range(100, 125))
    manager.attach_tiers(HeldKeys(TierKey(FULL_GROUP, h) for h in block_hashes(loaded_prompt, BS)))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                          enable_chunked_prefill=True), manager)
    long_running = Sequence("R", list(range(12)), SamplingParams(max_tokens=10), arrival=0)
    scheduler.add(long_running)
    while long_running.num_tokens < 16:
        compute(scheduler, scheduler.schedule())
    loaded = Sequence("L", loaded_prompt, SamplingParams(max_tokens=4), arrival=1)
    scheduler.add(loaded)
    compute(scheduler, scheduler.schedule())
    assert scheduler.take_started_loading() == [loaded]
    scheduler.loaded([loaded])
    for _ in range(100):
        if not scheduler.has_work():
            break
        batch = scheduler.schedule()
        started = scheduler.take_started_loading()   # (admitted from the tiers again after a preemption)
        assert batch is not None or started, "the scheduler stalled with work held"
        if batch is not None:
            compute(scheduler, batch)
        scheduler.loaded(started)                     # the tiers bring them back by the next step
    assert long_running.is_finished and loaded.is_finished
    assert manager.num_free_blocks == manager.num_blocks


def test_a_device_snapshot_is_copied_into_the_slot_before_another_capture_reuses_its_row():
    spec = StateSpec(conv_channels=2, conv_width=3, num_heads=1, key_dim=2, value_dim=2)
    slots = 2
    cache = LayerStateCache.allocate(spec, slots + 1 + slots, torch.float32, "cpu")   # slots, scratch, snapshots
    manager = BlockManager(64, BS, enable_prefix_caching=True, state_slots=slots)
    shared = list(range(100, 109))
    hashes = block_hashes(shared, BS)
    store = TieredStore([HostTier(1 << 20, EntrySizes({FULL_GROUP: 0}))])
    for h in hashes:
        store.save(TierKey(FULL_GROUP, h), torch.empty(0, dtype=torch.uint8))
    contents = BlockContents([cache], [], snapshot_base=slots + 1)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                                          enable_chunked_prefill=True), manager)
    tiers = EngineTiers(store, contents, WorkerAgreement(ParallelContext.single()))
    steps = TierSteps(tiers, scheduler, manager)
    # an earlier request left the snapshot after the shared prefix's second block on the device
    owner = Sequence("old", shared, SamplingParams(), arrival=0)
    owner.num_cached_tokens = len(shared)
    row = manager.snapshots.capture(owner, 8, hashes[1])
    manager.snapshots.forget_pending(owner)
    cache.conv[slots + 1 + row].fill_(42.0)
    cache.ssm[slots + 1 + row].fill_(-3.0)
    resumed = Sequence("L", shared, SamplingParams(max_tokens=2), arrival=1)
    other = Sequence("P", list(range(500, 520)), SamplingParams(max_tokens=2), arrival=2)
    scheduler.add(resumed)
    scheduler.add(other)
    scheduler.schedule()
    assert scheduler.loading == [resumed] and resumed.kv.state_restore == row
    assert row in [captured for _, captured in other.kv.state_captures], "the other request's capture takes the row"
    steps.after_schedule()
    assert resumed.kv.state_restore == -1, "copied now, not at its first step"
    cache.conv[slots + 1 + row].fill_(0.0)          # the other request's step writes its snapshot there
    assert torch.all(cache.conv[resumed.kv.state_slot] == 42.0) and torch.all(cache.ssm[resumed.kv.state_slot] == -3.0)
    tiers.close()
