"""One rank's KV tiers in its engine: what goes down when the device pool reuses a cached block, what comes back
when a request's prefix is found below, and what the ranks of its DP worker agree on.

The block manager keeps deciding (moe_runtime/kv_blocks/block_manager.py): a cached block or snapshot row it reuses is
a `TierSave`, a prefix found in a tier makes the request's admission a list of `TierLoad`s (the request then waits in
the scheduler's `loading` list, holding its blocks). This class moves the bytes, in an order that needs no locks:

1. after scheduling, the saves are read off the device (`save_evicted`, on the stepping thread, before the step's
   forward or any load can overwrite those blocks) and handed to the tiers (the disk writes on its own thread);
2. then the new loads start on the loader thread (`start`): the bytes come from host memory at once or from the
   disk's I/O thread, and are written into the request's own fresh blocks and slot, which nobody else reads, while
   the step runs;
3. before the next schedule, `finish` waits for them (usually long done), and the worker's ranks agree on how far
   each request's load succeeded on all of them; a request whose load failed anywhere gives its blocks back, the
   keys from the failed one on are forgotten on every rank, and it is admitted again (a shorter prefix, or none).

A load has exactly one step to overlap, whatever the ranks' clocks, so every rank of the worker schedules alike.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.kv_tiers.block_contents import BlockContents
from moe_runtime.kv_tiers.connector import KVTierConnector, TierCounters
from moe_runtime.kv_tiers.disk_tier import DiskTier
from moe_runtime.kv_tiers.entry_sizes import EntrySizes
from moe_runtime.kv_tiers.host_tier import HostTier
from moe_runtime.kv_tiers.tier_key import FULL_GROUP, TierKey
from moe_runtime.kv_tiers.tier_moves import TierLoad, TierSave
from moe_runtime.kv_tiers.tiered_store import TieredStore
from moe_runtime.kv_tiers.worker_agreement import WorkerAgreement

logger = logging.getLogger(__name__)

MAX_KINDS = 18   # the state snapshot, the full group and up to 16 windowed groups (a model has a few spans)


@dataclass(frozen=True)
class TierSettings:
    host_bytes: int = 0                 # --kv-host-memory (per rank; 0: no host tier)
    disk_dir: str | None = None         # --kv-disk-dir (None: no disk tier)
    disk_bytes: int = 0                 # --kv-disk-size

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None


@dataclass
class LoadInFlight:
    request: object                     # the Sequence waiting for it
    loads: list[TierLoad]
    outcome: Future                     # of the index of the first load that failed (len(loads): none)


@dataclass
class TierLoadCounters:
    requests: int = 0                   # admissions that loaded from the tiers
    failed: int = 0                     # ... of which failed on some rank of the worker (recomputed)
    seconds: float = 0.0                # loader-thread time writing entries back into the device pool
    blocked_seconds: float = 0.0        # stepping-thread time waiting for loads not done by the next step
    loaded_by_kind: dict[int, int] = field(default_factory=dict)   # entries written back, by TierKey.kind


class EngineTiers:
    def __init__(self, store: TieredStore, contents: BlockContents, agreement: WorkerAgreement,
                 disk: DiskTier | None = None):
        self.store = store
        self.contents = contents
        self.agreement = agreement
        self.disk = disk
        self.counters = TierLoadCounters()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-loader")
        self._in_flight: dict[str, LoadInFlight] = {}
        self._dropped: list[int] = []          # full-group hashes no tier holds any more (the router's evictions)
        self._restored: list[int] = []         # full-group hashes a disk tier found at start (the router's stores)
        self._lock = threading.Lock()
        on_gpu = any(t.is_cuda for kind in contents.kinds.values() for t in kind.tensors)
        # loads copy on a stream of their own, so they overlap the step's kernels (they write blocks no kernel reads)
        self._load_stream = torch.cuda.Stream() if on_gpu else None
        if disk is not None:   # the entries every rank of the worker found, in one order: their LRU order is alike
            disk.retain(agreement.common_keys(disk.keys()))
            self._restored = [key.block_hash for key in disk.keys() if key.kind == FULL_GROUP]

    @classmethod
    def for_engine(cls, settings: TierSettings, parallel: ParallelContext, contents: BlockContents,
                   fingerprint: str) -> "EngineTiers | None":
        """The tiers `settings` ask for (None: none), with entry sizes agreed over the whole job (every rank builds
        its engine at once) and the disk tier under `<disk_dir>/<fingerprint>/<this rank's place>`."""
        if not settings.enabled:
            return None
        sizes = agreed_entry_sizes(contents.entry_bytes(), parallel)
        tiers: list[KVTierConnector] = []
        if settings.host_bytes > 0:
            tiers.append(HostTier(settings.host_bytes, sizes))
        disk = None
        if settings.disk_dir is not None:
            place = f"dp{parallel.dp_rank}-pp{parallel.pp_rank}-tp{parallel.attn_tp_rank}-cp{parallel.cp_rank}"
            disk = DiskTier(Path(settings.disk_dir) / fingerprint / place, settings.disk_bytes, sizes)
            tiers.append(disk)
        logger.info("KV tiers: %s; entries of %s bytes on this rank", ", ".join(
            f"{tier.name} {tier.counters().capacity_bytes / 2**30:.2f} GiB" for tier in tiers), contents.entry_bytes())
        return cls(TieredStore(tiers), contents, agreement=WorkerAgreement(parallel), disk=disk)

    # ---- what the block manager asks ----------------------------------------------------------------------
    def holds(self, key: TierKey) -> bool:
        return self.store.holds(key)

    # ---- the stepping thread ------------------------------------------------------------------------------
    def save_evicted(self, saves: list[TierSave]) -> None:
        """Copy each reused block's bytes down (before the step or a load overwrites it) and keep them."""
        by_kind: dict[int, list[TierSave]] = {}
        for save in saves:
            by_kind.setdefault(save.key.kind, []).append(save)
        for kind, group in by_kind.items():
            for save, data in zip(group, self.contents.read(kind, [save.index for save in group])):
                for old in self.store.save(save.key, data):
                    if old.kind == FULL_GROUP:
                        self._dropped.append(old.block_hash)

    def fetch(self, loads: list[TierLoad]) -> list[Future]:
        """Ask the tiers for `loads`' bytes now, before this step's saves can push any of them out of a tier."""
        return [self.store.load_async(load.key) for load in loads]

    def start(self, request_id: str, request, loads: list[TierLoad], fetched: list[Future]) -> None:
        """Write `fetched` (`fetch(loads)`) into the request's blocks and slot on the loader thread, while the step
        runs (after this step's saves read the reused blocks: a fresh block may be one of them)."""
        self.counters.requests += 1
        ready = None
        if self._load_stream is not None:   # a fresh block may still be written by kernels queued before
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        outcome = self._loader.submit(self._load, loads, fetched, ready)
        self._in_flight[request_id] = LoadInFlight(request, loads, outcome)

    def finish(self) -> list[tuple[object, int]]:
        """Wait for every load started before, agree over the worker on each: (request, loads that succeeded on
        every rank, from the first). The keys past a failure are forgotten here, alike on every rank."""
        if not self._in_flight:
            return []
        started = time.perf_counter()
        flights = list(self._in_flight.values())   # in start order: the same on every rank
        self._in_flight.clear()
        local = [flight.outcome.result() for flight in flights]
        self.counters.blocked_seconds += time.perf_counter() - started
        agreed = self.agreement.minimum(local)
        outcomes = []
        for flight, succeeded in zip(flights, agreed):
            if succeeded < len(flight.loads):
                self.counters.failed += 1
                for load in flight.loads[succeeded:]:
                    self.store.drop(load.key)
                    if load.key.kind == FULL_GROUP:
                        self._dropped.append(load.key.block_hash)
            outcomes.append((flight.request, succeeded))
        return outcomes

    def wait_for(self, request_id: str) -> bool:
        """A loading request is leaving (aborted): let its load stop writing into its blocks first. True if it
        was loading."""
        flight = self._in_flight.pop(request_id, None)
        if flight is None:
            return False
        flight.outcome.result()
        return True

    def use_parallel(self, parallel: ParallelContext) -> None:
        """The job re-formed (a lost rank): agree over the new groups from now on."""
        self.agreement = WorkerAgreement(parallel)

    def wait_all(self) -> None:
        for request_id in list(self._in_flight):
            self.wait_for(request_id)

    def take_dropped(self) -> list[int]:
        """Full-group hashes no tier holds any more since the last call."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def take_restored(self) -> list[int]:
        """Full-group hashes a disk tier brought from a previous run (once)."""
        restored, self._restored = self._restored, []
        return restored

    def clear(self) -> None:
        """Forget every entry (POST /reset_prefix_cache); loads in flight keep the bytes they took."""
        self.store.clear()

    def tier_counters(self) -> list[TierCounters]:
        counters = self.store.counters()
        for tier in counters:
            if tier.name == "host":   # host loads are copies on the loader thread
                tier.load_seconds = self.counters.seconds
        return counters

    def close(self) -> None:
        self.wait_all()
        self._loader.shutdown(wait=True)
        self.store.close()

    # ---- the loader thread ---------------------------------------------------------------------------------
    def _load(self, loads: list[TierLoad], futures: list[Future], ready) -> int:
        if self._load_stream is None:
            return self._write_back(loads, futures)
        self._load_stream.wait_event(ready)
        with torch.cuda.stream(self._load_stream):
            written = self._write_back(loads, futures)
        self._load_stream.synchronize()
        return written

    def _write_back(self, loads: list[TierLoad], futures: list[Future]) -> int:
        started = time.perf_counter()
        try:
            for index, (load, future) in enumerate(zip(loads, futures)):
                try:
                    data = future.result()
                    if data is None:
                        return index
                    self.contents.write(load.key.kind, load.target, data)
                except Exception as exc:  # noqa: BLE001 - any failure here is a miss the worker agrees on, not a crash
                    logger.warning("KV tiers: entry %s could not be written back (%s); a miss", load.key, exc)
                    return index
                with self._lock:
                    kinds = self.counters.loaded_by_kind
                    kinds[load.key.kind] = kinds.get(load.key.kind, 0) + 1
            return len(loads)
        finally:
            with self._lock:
                self.counters.seconds += time.perf_counter() - started


def agreed_entry_sizes(local: dict[int, int], parallel: ParallelContext) -> EntrySizes:
    """Each kind's entry bytes as the largest on any rank (a kind a rank lacks counts 0 there)."""
    if parallel.world_size == 1:
        return EntrySizes(dict(local))
    values = torch.zeros(MAX_KINDS, dtype=torch.int64)   # row kind + 1: state snapshots, the full group, windows
    for kind, size in local.items():
        values[kind + 1] = size
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=parallel.world_control_group)
    return EntrySizes({row - 1: size for row, size in enumerate(values.tolist()) if size > 0})


def cache_fingerprint(checkpoint_dir: Path, dtype: torch.dtype, block_size: int, layout: str,
                      entry_bytes: dict[int, int]) -> str:
    """A name for the model, weights, dtype, block size and cache layout whose entries a disk tier keeps: another
    checkpoint (or the same one re-saved), dtype, block size or parallel layout reads none of them."""
    digest = hashlib.sha256()
    digest.update(f"{dtype}|{block_size}|{layout}|{sorted(entry_bytes.items())}".encode())
    for path in sorted(checkpoint_dir.iterdir()):
        if path.is_file() and (path.suffix in (".json", ".safetensors", ".bin") or path.name.endswith(".model")):
            stat = path.stat()
            digest.update(f"|{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            if path.name == "config.json":
                digest.update(path.read_bytes())
    return digest.hexdigest()[:24]
