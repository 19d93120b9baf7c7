"""Tier 2: KV entries as files under a directory, bounded in bytes, kept across restarts.

Every write, read and delete runs on the tier's own I/O thread, in the order asked (a read asked after a write of
the same key finds the file; a delete asked after a read does not pull it away), so the stepping thread never waits
for the disk. An entry is held from the moment it is saved (`lookup` says so at once, alike on every rank): until
its file is written, a load gets the bytes waiting to be written. Writes waiting beyond `max_pending_bytes` are
dropped (the entry then loads as a miss). A full disk or an I/O error fails that entry alone, with one log line, and
the tier goes on. On start the directory's files are the index again (newest kept within the bound), so a
restarted `moe-serve` reuses what its previous run wrote: the directory is specific to the model, the cache
layout and this rank (`EngineTiers` names it), and each file is checked against its hash when loaded.
"""
from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import torch

from moe_runtime.kv_tiers.connector import TierCounters
from moe_runtime.kv_tiers.entry_sizes import EntrySizes
from moe_runtime.kv_tiers.host_tier import completed
from moe_runtime.kv_tiers.tier_file import TierFileError, read_entry, write_entry
from moe_runtime.kv_tiers.tier_key import TierKey

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 1 << 30


class UnsafeTierDirectory(OSError):
    """A tier directory another user could write into or swap (its files would be trusted on load)."""


def private_directory(directory: Path, levels: int = 3) -> None:
    """Create `directory` (and missing parents) 0700, then refuse it, or any of its `levels - 1` parents (the tier's
    own levels: `<kv-disk-dir>/<fingerprint>/<rank>`), that is a symbolic link, another user's, or writable by others."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in [directory, *directory.parents][:levels]:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise UnsafeTierDirectory(f"KV disk tier: {path} is not a plain directory")
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeTierDirectory(f"KV disk tier: {path} must be this user's and not writable by others "
                                      f"(owner {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})")
    os.chmod(directory, 0o700)


class DiskTier:
    name = "disk"

    def __init__(self, directory: Path, capacity_bytes: int, sizes: EntrySizes,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.sizes = sizes
        self.max_pending_bytes = max_pending_bytes
        private_directory(self.directory)
        self._index: OrderedDict[TierKey, None] = OrderedDict()   # least recently used first
        self._used = 0
        self._pending: dict[TierKey, torch.Tensor] = {}           # saved, not written yet
        self._pending_bytes = 0
        self._failed: set[TierKey] = set()                         # writes that did not happen
        self._lock = threading.Lock()
        self._counters = TierCounters(self.name, capacity_bytes)
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-tier", daemon=True)
        self._warm_start()
        self._thread.start()

    # ---- the stepping thread ---------------------------------------------------------------------------
    def lookup(self, key: TierKey) -> bool:
        return key in self._index

    def keys(self) -> list[TierKey]:
        return list(self._index)

    def save_async(self, key: TierKey, data: torch.Tensor) -> list[TierKey]:
        size = self.sizes.of(key)
        if size > self.capacity_bytes:
            return []
        if key in self._index:
            self._index.move_to_end(key)
            return []
        evicted = self._make_room(size)
        self._index[key] = None
        self._used += size
        with self._lock:
            self._failed.discard(key)
            if self._pending_bytes + data.numel() > self.max_pending_bytes:
                self._failed.add(key)
                self._counters.errors += 1
                logger.warning("KV disk tier: %d MiB of writes are waiting; dropped the write of %s (a miss if asked)",
                               self._pending_bytes >> 20, key.file_name)
                return evicted
            self._pending[key] = data
            self._pending_bytes += data.numel()
        self._jobs.put(("write", key, data))
        return evicted

    def load_async(self, key: TierKey) -> Future:
        if key not in self._index:
            return completed(None)
        self._index.move_to_end(key)
        with self._lock:
            if key in self._failed:
                self._counters.misses += 1
                return completed(None)
            data = self._pending.get(key)
            if data is not None:
                self._counters.hits += 1
                self._counters.loaded_bytes += data.numel()
                return completed(data)
        future: Future = Future()
        self._jobs.put(("read", key, future))
        return future

    def evict(self, key: TierKey) -> None:
        if key in self._index:
            del self._index[key]
            self._used -= self.sizes.of(key)
            self._jobs.put(("delete", key, None))

    def retain(self, keys: list[TierKey]) -> None:
        """Keep exactly `keys`, least recently used first (what every rank of the DP worker found on its disk at
        start, in the order they agreed): the rest is forgotten and its files removed."""
        kept = set(keys)
        for key in [key for key in self._index if key not in kept]:
            self.evict(key)
        self._index = OrderedDict((key, None) for key in keys if key in self._index)

    def clear(self) -> None:
        for key in list(self._index):
            self.evict(key)

    def counters(self) -> TierCounters:
        with self._lock:
            self._counters.used_bytes = self._used
            self._counters.entries = len(self._index)
            return TierCounters(**vars(self._counters))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every job asked so far ran (tests, shutdown)."""
        if not self._thread.is_alive():
            return
        done = threading.Event()
        self._jobs.put(("flush", None, done))
        done.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._jobs.put(("stop", None, None))
        self._thread.join(timeout=10)

    def _make_room(self, size: int) -> list[TierKey]:
        evicted = []
        while self._index and self._used + size > self.capacity_bytes:
            old = next(iter(self._index))
            self.evict(old)
            evicted.append(old)
        return evicted

    def _warm_start(self) -> None:
        """Index the files a previous run left, most recently written last, within the bound; remove the rest and
        any half-written temporary file."""
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            key = TierKey.from_file_name(path.name)
            if key is None or key.kind not in self.sizes.by_kind or not path.is_file():
                continue
            found.append((path.stat().st_mtime_ns, key))
        kept = 0
        for _, key in sorted(found, reverse=True):
            if self._used + self.sizes.of(key) <= self.capacity_bytes:
                self._index[key] = None
                self._used += self.sizes.of(key)
                kept += 1
            else:
                (self.directory / key.file_name).unlink(missing_ok=True)
        self._index = OrderedDict(reversed(self._index.items()))
        if kept:
            logger.info("KV disk tier: %d entries (%.1f MiB) from a previous run in %s", kept, self._used / 2**20,
                        self.directory)

    # ---- the I/O thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job, key, extra = self._jobs.get()
            if job == "stop":
                return
            try:
                if job == "flush":
                    extra.set()
                elif job == "write":
                    self._write(key, extra)
                elif job == "read":
                    extra.set_result(self._read(key))
                elif job == "delete":
                    self._delete(key)
            except Exception as exc:  # noqa: BLE001 - the thread outlives any one job: a read that fails is a miss
                logger.warning("KV disk tier: %s of %s failed (%s)", job, key.file_name if key else "-", exc)
                if job == "read" and not extra.done():
                    extra.set_result(None)

    def _write(self, key: TierKey, data: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            write_entry(self.directory / key.file_name, key, data)
            failed = False
        except OSError as exc:
            failed = True
            logger.warning("KV disk tier: writing %s failed (%s); it will be a miss", key.file_name, exc)
        with self._lock:
            if self._pending.get(key) is data:
                del self._pending[key]
                self._pending_bytes -= data.numel()
            if failed:
                self._failed.add(key)
                self._counters.errors += 1
            else:
                self._counters.saved += 1
                self._counters.saved_bytes += data.numel()
            self._counters.save_seconds += time.perf_counter() - started

    def _read(self, key: TierKey) -> torch.Tensor | None:
        started = time.perf_counter()
        with self._lock:
            data = self._pending.get(key)
        if data is None:
            try:
                data = read_entry(self.directory / key.file_name, key, max(self.sizes.of(key), 0))
            except (OSError, TierFileError) as exc:
                data = None
                logger.warning("KV disk tier: %s is a miss (%s)", key.file_name, exc)
        with self._lock:
            if data is None:
                self._counters.misses += 1
                self._counters.errors += 1
            else:
                self._counters.hits += 1
                self._counters.loaded_bytes += data.numel()
            self._counters.load_seconds += time.perf_counter() - started
        return data

    def _delete(self, key: TierKey) -> None:
        with self._lock:
            data = self._pending.pop(key, None)
            if data is not None:
                self._pending_bytes -= data.numel()
            self._failed.discard(key)
        if key not in self._index:   # saved again since: its new write is queued after this delete... keep it
            try:
                (self.directory / key.file_name).unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("KV disk tier: removing %s failed (%s)", key.file_name, exc)
