"""Where an engine core meets its KV tiers: around each schedule, at an import's allocation, on abort, in its stats.

Without tiers every call here does nothing, so the core calls them unconditionally (`TierSteps.open` returns the
empty one). The order each step is `EngineTiers`' (moe_runtime/kv_tiers/engine_tiers.py): settle the loads started
before, schedule, read the reused blocks down, start the new loads.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.kv_blocks.prefix_cache import PrefixCacheEvents
from moe_runtime.engine.scheduler import Scheduler
from moe_runtime.kv_tiers.block_contents import BlockContents
from moe_runtime.kv_tiers.engine_tiers import EngineTiers, TierSettings, cache_fingerprint
from moe_runtime.engine.tier_router_view import held_anywhere

logger = logging.getLogger(__name__)

SHUTDOWN_CHUNK = 256   # entries read down per flush of the disk tier at shutdown


class TierSteps:
    def __init__(self, tiers: EngineTiers | None, scheduler: Scheduler, block_manager: BlockManager):
        self.tiers = tiers
        self.scheduler = scheduler
        self.block_manager = block_manager
        if tiers is not None:
            block_manager.attach_tiers(tiers)

    @classmethod
    def open(cls, config: EngineConfig, parallel: ParallelContext, runner, drafter_caches: list,
             scheduler: Scheduler, block_manager: BlockManager, checkpoint_dir: Path,
             dtype: torch.dtype) -> "TierSteps":
        """The tiers `config` asks for over `runner`'s caches and a model drafter's (every rank of the job opens its
        own at once: their entry sizes are agreed over the job)."""
        settings = TierSettings(config.kv_host_memory, config.kv_disk_dir, config.kv_disk_size)
        if not settings.enabled:
            return cls(None, scheduler, block_manager)
        contents = BlockContents(runner.caches, drafter_caches, snapshot_base=runner.state_slots + 1,
                                 pin_memory=runner.device.type == "cuda")
        layout = (f"tp{parallel.attn_tp_size}-cp{parallel.cp_size}-pp{parallel.pp_size}-{parallel.stage_layers}-"
                  f"{config.speculative_config}-{config.quantization}-{config.kernels}")
        fingerprint = cache_fingerprint(checkpoint_dir, dtype, config.block_size, layout, contents.entry_bytes())
        return cls(EngineTiers.for_engine(settings, parallel, contents, fingerprint), scheduler, block_manager)

    def before_schedule(self) -> None:
        """The loads started before the last step are back (or failed somewhere): their requests queue again."""
        if self.tiers is None:
            return
        loaded = []
        for seq, succeeded in self.tiers.finish():
            if succeeded == len(seq.kv.tier_loads):
                loaded.append(seq)
            else:
                logger.info("request %s: %d of its %d KV tier entries could not be loaded on every rank; it is "
                            "admitted again", seq.request_id, len(seq.kv.tier_loads) - succeeded, len(seq.kv.tier_loads))
                self.scheduler.load_failed(seq)
        self.scheduler.loaded(loaded)

    def after_schedule(self) -> None:
        """What the block manager just decided: the new loads take their bytes from the tiers first (this step's saves
        could push them out), reused cached blocks go down (before anything overwrites them), then the loads start
        writing. A request that also resumes a device snapshot gets it copied into its slot now: the row is not held
        for it and may be reused before its first step."""
        if self.tiers is None:
            return
        started = self.scheduler.take_started_loading()
        fetched = [self.tiers.fetch(seq.kv.tier_loads) for seq in started]
        self.save_evicted()
        for seq, futures in zip(started, fetched):
            if seq.kv.state_restore >= 0:
                self.tiers.contents.restore_row(seq.kv.state_restore, seq.kv.state_slot)
                seq.kv.state_restore = -1
            self.tiers.start(seq.request_id, seq, seq.kv.tier_loads, futures)

    def save_evicted(self) -> None:
        """Cached blocks reused outside a schedule (a P/D import's allocation) go down before a pull writes them."""
        if self.tiers is not None:
            self.tiers.save_evicted(self.block_manager.take_evictions())

    def stop_loads(self, request_id: str) -> None:
        """A request leaving: a load in flight stops writing into its blocks before they are freed."""
        if self.tiers is not None:
            self.tiers.wait_for(request_id)

    def stats_fields(self) -> dict:
        """The WorkerStats fields of the tiers."""
        if self.tiers is None:
            return {}
        return dict(loading=len(self.scheduler.loading), kv_tier_hit_tokens=self.block_manager.tier_hit_tokens,
                    kv_tier_failed_loads=self.tiers.counters.failed, kv_tiers=self.tiers.tier_counters())

    def clear(self) -> None:
        if self.tiers is not None:
            self.tiers.clear()

    def router_events(self, events: PrefixCacheEvents | None) -> PrefixCacheEvents | None:
        """The device pool's changes as the front's router hears them: held while the device or a tier holds it."""
        if self.tiers is None or events is None:
            return events
        return held_anywhere(events, self.tiers, self.block_manager.pool)

    def close(self) -> None:
        """With a disk tier, the device's cached blocks go down to it first (written through the host tier): a restart
        finds the most recent prefixes too, not only what was evicted before."""
        if self.tiers is None:
            return
        if self.tiers.disk is not None:
            saves = [save for save in self.block_manager.cached_entries() if not self.tiers.holds(save.key)]
            for first in range(0, len(saves), SHUTDOWN_CHUNK):   # a bounded amount of bytes waits for the disk
                self.tiers.save_evicted(saves[first : first + SHUTDOWN_CHUNK])
                self.tiers.disk.flush()
            logger.info("KV tiers: %d cached entries written down at shutdown", len(saves))
        self.tiers.close()

    def use_parallel(self, parallel: ParallelContext) -> None:
        """The job re-formed: the worker's groups are new."""
        if self.tiers is not None:
            self.tiers.use_parallel(parallel)
