"""One disk-tier entry as a file: a fixed header (magic, key, length, SHA-256 of the payload), then the payload.

A file is written under a temporary name with mode 0600 and renamed into place, so a reader never sees half of
one; a file whose header, length or hash does not match what its name promises is rejected on reading (a
corrupted or truncated file is a miss, never a wrong answer).
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import torch

from moe_runtime.kv_tiers.tier_key import TierKey

MAGIC = b"MOEKVT01"
HEADER = struct.Struct("<8sqqq32s")     # magic, kind, block hash, payload bytes, sha256(payload)


class TierFileError(ValueError):
    """A tier file that is not the entry its name says (truncated, corrupted, another key's)."""


def write_entry(path: Path, key: TierKey, data: torch.Tensor) -> None:
    """Write `data` (uint8 [N], CPU) for `key` at `path` (0600, atomically); raises OSError (a full disk...)."""
    payload = memoryview(data.contiguous().numpy())
    header = HEADER.pack(MAGIC, key.kind, key.block_hash, payload.nbytes, hashlib.sha256(payload).digest())
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(header)
            file.write(payload)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_entry(path: Path, key: TierKey, max_bytes: int) -> torch.Tensor:
    """The payload of `key`'s file (uint8 [N]); raises TierFileError when it is not that entry, OSError on I/O."""
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | getattr(os, "O_NOFOLLOW", 0))) as file:
        header = file.read(HEADER.size)
        if len(header) != HEADER.size:
            raise TierFileError(f"{path.name}: truncated header")
        magic, kind, block_hash, length, digest = HEADER.unpack(header)
        if magic != MAGIC or (kind, block_hash) != (key.kind, key.block_hash):
            raise TierFileError(f"{path.name}: not this entry's file")
        if not 0 <= length <= max_bytes:
            raise TierFileError(f"{path.name}: a payload of {length} bytes (at most {max_bytes} expected)")
        data = torch.empty(length, dtype=torch.uint8)
        view = memoryview(data.numpy())
        if file.readinto(view) != length or file.read(1):
            raise TierFileError(f"{path.name}: truncated or overlong payload")
    if hashlib.sha256(view).digest() != digest:
        raise TierFileError(f"{path.name}: content hash mismatch")
    return data
