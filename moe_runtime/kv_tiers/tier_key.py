"""What a tier entry is: one KV cache group's block, or one recurrent-state snapshot, of a prefix hash.

A prefix hash (moe_runtime/kv_blocks/prefix_hash.py) names a prefix; the entries kept for it are the full group's block
that ends it (every full-attention layer's K/V, MLA latents, sparse attention's index keys, DeepSeek-V4's compressed
entries, a drafter's rows), each windowed group's block of the same positions, and the snapshot of the recurrent and
compressed states after it. A tenant's `cache_salt` roots its hash chain, so salted entries never meet unsalted ones.
"""
from __future__ import annotations

from dataclasses import dataclass

FULL_GROUP = 0        # the full KV group's block
STATE_SNAPSHOT = -1   # the states after the prefix (linear-attention layers, DeepSeek-V4's rings)


@dataclass(frozen=True)
class TierKey:
    kind: int           # FULL_GROUP, a windowed group's index (1, 2, ...), or STATE_SNAPSHOT
    block_hash: int     # the prefix hash (63-bit, non-negative)

    @property
    def file_name(self) -> str:
        kind = "s" if self.kind == STATE_SNAPSHOT else f"g{self.kind}"
        return f"{kind}-{self.block_hash:016x}.kv"

    @classmethod
    def from_file_name(cls, name: str) -> "TierKey | None":
        """The key a tier file is named after (None: not a tier file's name)."""
        if not name.endswith(".kv") or "-" not in name:
            return None
        kind_text, hash_text = name[:-3].split("-", 1)
        try:
            block_hash = int(hash_text, 16)
            kind = STATE_SNAPSHOT if kind_text == "s" else int(kind_text[1:]) if kind_text[:1] == "g" else None
        except ValueError:
            return None
        if kind is None or not 0 <= block_hash < 2**63 or kind < STATE_SNAPSHOT:
            return None
        key = cls(kind, block_hash)
        return key if key.file_name == name else None   # one spelling per key: two files never count as one
