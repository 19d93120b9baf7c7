"""The two moves between the device pool and the tiers, as the block manager plans them."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.kv_tiers.tier_key import TierKey


@dataclass(frozen=True)
class TierSave:
    """A cached block (or snapshot row) the device pool is reusing: its bytes go down before anything overwrites
    them."""

    key: TierKey
    index: int          # block id in the key's group's pool, or snapshot row (STATE_SNAPSHOT)


@dataclass(frozen=True)
class TierLoad:
    """An entry a request admitted from the tiers needs back before its first step."""

    key: TierKey
    target: int         # block id in the key's group's pool, or the request's state slot (STATE_SNAPSHOT)
