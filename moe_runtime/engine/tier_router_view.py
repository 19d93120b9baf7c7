"""What the front's cache-aware router is told a DP worker holds, with KV tiers: a prefix block is held while the
device pool or a tier holds it, so a worker that can load a prefix from host memory or disk wins over one that must
compute it (loading is far cheaper than a prefill)."""
from __future__ import annotations

from moe_runtime.kv_blocks.block_pool import BlockPool
from moe_runtime.kv_blocks.prefix_cache import PrefixCacheEvents
from moe_runtime.kv_tiers.engine_tiers import EngineTiers
from moe_runtime.kv_tiers.tier_key import FULL_GROUP, TierKey


def held_anywhere(events: PrefixCacheEvents, tiers: EngineTiers, pool: BlockPool) -> PrefixCacheEvents:
    """`events` of the device pool, restated for the device and the tiers together: an eviction from the device of a
    block a tier keeps is no eviction, a tier dropping a block the device does not hold is one, and the blocks a
    disk tier found from a previous run are stored. A hash stays in at most one list."""
    stored = list(dict.fromkeys([*events.stored, *tiers.take_restored()]))
    in_stored = set(stored)
    evicted = [h for h in events.evicted if not tiers.holds(TierKey(FULL_GROUP, h))]
    evicted += [h for h in tiers.take_dropped() if pool.cached(h) is None and not tiers.holds(TierKey(FULL_GROUP, h))]
    evicted = [h for h in dict.fromkeys(evicted) if h not in in_stored]
    return PrefixCacheEvents(stored, evicted, events.cleared)
