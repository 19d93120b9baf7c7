"""Content addresses of full KV blocks: a block's hash covers its tokens and, through its parent's
hash, every token before it, so equal hashes mean equal prefixes (and therefore equal K/V).

The hash must be the same in every process: the ranks key their prefix caches with it, and the
front's cache-aware router looks up what each DP worker reported. Python's `hash()` of a tuple is
salted per process for strings and is not a content hash, so the chain uses SHA-256 (truncated to
63 bits: a plain non-negative int that msgpack and JSON carry as is; by the birthday bound, a
collision among a million cached blocks has odds of about 1e-7).

A request's `cache_salt` (vLLM's field) becomes the chain's root (`chain_root`): the first block's parent,
so every block of a salted request hashes apart from the same tokens under another salt or none. Tenants
with different salts never share a block, and cannot learn from a cache hit's speed what another one sent.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence as SequenceOf

BlockHash = int

ROOT_HASH: BlockHash = 0          # the parent of a sequence's first block
HASH_BITS = 63


def chain_root(cache_salt: str | None) -> BlockHash:
    """The parent of a sequence's first block: `ROOT_HASH` unsalted, else a hash of the salt (domain-separated
    from block hashes, which hash int64s only)."""
    if cache_salt is None:
        return ROOT_HASH
    digest = hashlib.sha256(b"moe-runtime cache salt\0" + cache_salt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << HASH_BITS) - 1)


def hash_block(parent: BlockHash, token_ids: SequenceOf[int]) -> BlockHash:
    """The hash of one full block of `token_ids` whose prefix hashes to `parent`."""
    digest = hashlib.sha256(struct.pack(f"<q{len(token_ids)}q", parent, *token_ids)).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << HASH_BITS) - 1)


def extend_block_hashes(hashes: list[BlockHash], token_ids: SequenceOf[int], block_size: int,
                        num_blocks: int | None = None, root: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Append to `hashes` (the chain of the first len(hashes) blocks of `token_ids`, from `root`) the hashes of
    the following full blocks, up to `num_blocks` blocks in all (default: every full block). Returns `hashes`."""
    full = len(token_ids) // block_size
    stop = full if num_blocks is None else min(num_blocks, full)
    parent = hashes[-1] if hashes else root
    for index in range(len(hashes), stop):
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: SequenceOf[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """The hashes of every full block of `token_ids` (a partial last block has none), salted by `cache_salt`."""
    return extend_block_hashes([], token_ids, block_size, root=chain_root(cache_salt))
