"""The KV tiers' stores on their own: the host tier's byte bound and LRU, the disk tier's files (0600, content hash,
atomic writes), its failures degrading to misses with one log line, its warm start, and the write-through store."""
from __future__ import annotations

import errno
import logging
import os
import stat

import pytest
import torch

from moe_runtime.kv_tiers import disk_tier as disk_module
from moe_runtime.kv_tiers.disk_tier import DiskTier
from moe_runtime.kv_tiers.entry_sizes import EntrySizes
from moe_runtime.kv_tiers.host_tier import HostTier
from moe_runtime.kv_tiers.tier_file import HEADER
from moe_runtime.kv_tiers.tier_key import FULL_GROUP, STATE_SNAPSHOT, TierKey
from moe_runtime.kv_tiers.tiered_store import TieredStore
from moe_runtime.kv_tiers.worker_agreement import WorkerAgreement
from moe_runtime.config.parallel_context import ParallelContext

ENTRY = 64
SIZES = EntrySizes({FULL_GROUP: ENTRY, STATE_SNAPSHOT: 2 * ENTRY, 1: ENTRY})


def entry(seed: int, size: int = ENTRY) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def key(block_hash: int, kind: int = FULL_GROUP) -> TierKey:
    return TierKey(kind, block_hash)


def test_tier_file_names_round_trip_and_junk_is_not_a_key():
    for k in (key(0), key(2**63 - 1, STATE_SNAPSHOT), key(12345, 3)):
        assert TierKey.from_file_name(k.file_name) == k
    for junk in ("x.kv", "g0-12.kv", "g0-000000000000_001.kv", "g0-+00000000000001.kv", "G0-0000000000000001.kv", "g0-zzzzzzzzzzzzzzzz.kv", "q1-0000000000000001.kv", "g0-0000000000000001",
                 "g-2-0000000000000001.kv", "g0-ffffffffffffffff.kv"):
        assert TierKey.from_file_name(junk) is None, junk


def test_the_host_tier_is_bounded_by_the_agreed_sizes_least_recently_used_out_first():
    host = HostTier(4 * ENTRY, SIZES)
    for i in range(4):
        assert host.save_async(key(i), entry(i)) == []
    assert host.load_async(key(0)).result() is not None        # 0 is now the most recently used
    assert host.save_async(key(9, STATE_SNAPSHOT), entry(9, 2 * ENTRY)) == [key(1), key(2)]
    assert [host.lookup(key(i)) for i in range(4)] == [True, False, False, True]
    assert torch.equal(host.load_async(key(3)).result(), entry(3))
    assert host.load_async(key(1)).result() is None
    counters = host.counters()
    assert (counters.used_bytes, counters.entries, counters.hits, counters.misses) == (4 * ENTRY, 3, 2, 1)
    small = HostTier(ENTRY, SIZES)
    assert small.save_async(key(5, STATE_SNAPSHOT), entry(5, 2 * ENTRY)) == [] and not small.lookup(
        key(5, STATE_SNAPSHOT)), "an entry larger than the tier is not kept (and evicts nothing)"


def test_a_load_keeps_its_bytes_when_the_entry_is_evicted_after_it_was_asked():
    host = HostTier(ENTRY, SIZES)
    host.save_async(key(1), entry(1))
    future = host.load_async(key(1))
    host.save_async(key(2), entry(2))
    assert not host.lookup(key(1)) and torch.equal(future.result(), entry(1))


@pytest.fixture
def disk(tmp_path):
    tiers = []

    def make(capacity: int = 8 * ENTRY, directory=None, **kwargs) -> DiskTier:
        tier = DiskTier(directory or tmp_path / "tier", capacity, SIZES, **kwargs)
        tiers.append(tier)
        return tier
    yield make
    for tier in tiers:
        tier.close()


def test_disk_files_are_private_hash_checked_and_read_back(disk, tmp_path):
    tier = disk()
    tier.save_async(key(7), entry(7))
    tier.flush()
    path = tmp_path / "tier" / key(7).file_name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "tier").stat().st_mode) == 0o700
    assert path.stat().st_size == HEADER.size + ENTRY
    assert torch.equal(tier.load_async(key(7)).result(timeout=10), entry(7))
    assert not list((tmp_path / "tier").glob("*.tmp")), "written under a temporary name, then renamed"


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "another key's file", "empty"])
def test_a_damaged_file_is_a_miss_with_one_log_line(disk, tmp_path, damage, caplog):
    tier = disk()
    tier.save_async(key(1), entry(1))
    tier.save_async(key(2), entry(2))
    tier.flush()
    path = tmp_path / "tier" / key(1).file_name
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-1] ^= 0xFF
    elif damage == "truncate":
        data = data[:-5]
    elif damage == "another key's file":
        data = bytearray((tmp_path / "tier" / key(2).file_name).read_bytes())
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
        assert tier.load_async(key(1)).result(timeout=10) is None
    assert len([r for r in caplog.records if key(1).file_name in r.getMessage()]) == 1
    assert tier.counters().misses == 1
    assert torch.equal(tier.load_async(key(2)).result(timeout=10), entry(2)), "the other entries are untouched"


def test_a_failed_write_is_a_miss_and_the_tier_goes_on(disk, monkeypatch, caplog):
    real = disk_module.write_entry

    def full_disk(path, k, data):
        if k == key(1):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, k, data)
    monkeypatch.setattr(disk_module, "write_entry", full_disk)
    tier = disk()
    with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
        tier.save_async(key(1), entry(1))
        tier.save_async(key(2), entry(2))
        tier.flush()
        assert tier.lookup(key(1)), "the index changes only by saves and evictions (alike on every rank)"
        assert tier.load_async(key(1)).result(timeout=10) is None
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(tier.load_async(key(2)).result(timeout=10), entry(2))
    assert tier.counters().errors >= 1


def test_a_load_before_the_write_gets_the_waiting_bytes_and_too_many_waiting_writes_are_dropped(disk, monkeypatch):
    gate = __import__("threading").Event()
    real = disk_module.write_entry
    monkeypatch.setattr(disk_module, "write_entry", lambda *args: (gate.wait(10), real(*args)))
    tier = disk(max_pending_bytes=2 * ENTRY)
    tier.save_async(key(1), entry(1))
    tier.save_async(key(2), entry(2))
    tier.save_async(key(3), entry(3))                 # a third waiting write is over the bound: dropped
    assert torch.equal(tier.load_async(key(1)).result(timeout=1), entry(1)), "served before its file exists"
    assert tier.load_async(key(3)).result(timeout=1) is None
    gate.set()
    tier.flush()
    assert torch.equal(tier.load_async(key(2)).result(timeout=10), entry(2))


def test_the_disk_tier_is_bounded_and_deletes_what_it_evicts(disk, tmp_path):
    tier = disk(capacity=3 * ENTRY)
    for i in range(5):
        tier.save_async(key(i), entry(i))
    tier.flush()
    assert [tier.lookup(key(i)) for i in range(5)] == [False, False, True, True, True]
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == sorted(key(i).file_name for i in (2, 3, 4))


def test_a_restart_finds_the_files_newest_kept_within_the_bound(disk, tmp_path):
    first = disk()
    for i in range(4):
        first.save_async(key(i), entry(i))
        first.flush()
        os.utime(tmp_path / "tier" / key(i).file_name, ns=(10**18 + i * 10**9,) * 2)
    first.close()
    (tmp_path / "tier" / "g0-00000000000000aa.kv.tmp").write_bytes(b"half")
    (tmp_path / "tier" / "notes.txt").write_text("not ours")
    again = disk(capacity=2 * ENTRY)
    assert [again.lookup(key(i)) for i in range(4)] == [False, False, True, True]
    assert torch.equal(again.load_async(key(3)).result(timeout=10), entry(3))
    assert not (tmp_path / "tier" / "g0-00000000000000aa.kv.tmp").exists()
    assert (tmp_path / "tier" / "notes.txt").exists(), "files that are not the tier's are left alone"


def test_the_store_writes_through_and_drops_only_what_no_tier_holds(disk):
    host = HostTier(2 * ENTRY, SIZES)
    store = TieredStore([host, disk(capacity=3 * ENTRY)])
    assert [store.save(key(i), entry(i)) for i in range(3)] == [[], [], []]
    assert not host.lookup(key(0)) and store.holds(key(0)), "the disk still has what the host let go"
    assert store.save(key(3), entry(3)) == [key(0)], "gone from both tiers"
    assert store.save(key(4), entry(4)) == [key(1)]
    assert torch.equal(store.load_async(key(2)).result(timeout=10), entry(2)), "from the disk"
    assert torch.equal(store.load_async(key(4)).result(timeout=10), entry(4)), "from the host"
    store.drop(key(2))
    assert not store.holds(key(2))
    store.close()


def test_one_rank_agrees_with_itself():
    agreement = WorkerAgreement(ParallelContext.single())
    assert agreement.alone and agreement.minimum([3, 0, 5]) == [3, 0, 5]
    assert agreement.common_keys([key(2), key(1)]) == [key(2), key(1)], "in the order given"


class FakeTiers:
    """What `held_anywhere` asks of a worker's tiers."""

    def __init__(self, held: set[int], dropped: list[int], restored: list[int]):
        self.held, self.dropped, self.restored = held, dropped, restored

    def holds(self, k: TierKey) -> bool:
        return k.kind == FULL_GROUP and k.block_hash in self.held

    def take_dropped(self) -> list[int]:
        return self.dropped

    def take_restored(self) -> list[int]:
        return self.restored


def test_the_router_hears_of_a_block_held_in_a_tier_as_held_by_its_worker():
    from moe_runtime.attention_dp.prefix_index import PrefixCacheIndex
    from moe_runtime.kv_blocks.block_pool import BlockPool
    from moe_runtime.kv_blocks.prefix_cache import PrefixCacheEvents
    from moe_runtime.engine.tier_router_view import held_anywhere

    pool = BlockPool(4, enable_prefix_caching=True)
    block = pool.take()
    pool.store(block, 50)                                   # 50 is on the device
    tiers = FakeTiers(held={10, 11}, dropped=[12, 50, 13], restored=[20])
    device = PrefixCacheEvents(stored=[50, 13], evicted=[10, 11, 14])
    events = held_anywhere(device, tiers, pool)
    assert events.stored == [50, 13, 20], "a disk tier's blocks from a previous run are held"
    assert events.evicted == [14, 12], "evicted only where no tier keeps it and the device does not hold it"
    index = PrefixCacheIndex(2)
    index.apply(0, PrefixCacheEvents(stored=[10, 11, 12, 14]))
    index.apply(0, events)
    assert index.cached_blocks(0, [10, 11, 50]) == 3 and index.cached_blocks(1, [10]) == 0


def test_a_tier_directory_others_could_write_or_swap_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(disk_module.UnsafeTierDirectory, match="not writable by others"):
        DiskTier(shared / "fingerprint" / "rank", 8 * ENTRY, SIZES)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(disk_module.UnsafeTierDirectory, match="not a plain directory"):
        DiskTier(tmp_path / "link", 8 * ENTRY, SIZES)
