"""The KV cache part of the engine's settings: the device block pool, prefix caching, and the host and disk tiers
below the pool."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.config_error import EngineConfigError


@dataclass
class CacheSettings:
    block_size: int = 16
    kv_cache_memory: int = 256 * 2**20   # bytes of KV cache per DP worker
    enable_prefix_caching: bool = True    # full KV blocks are reused by requests sharing a prefix
    # KV tiers below the device pool (moe_runtime/kv_tiers): blocks the pool evicts are kept in host memory and/or
    # on disk, and a prefix found there is loaded back instead of computed again. Sizes are per rank (each keeps its
    # own layers and heads), like kv_cache_memory.
    kv_host_memory: int = 0               # bytes of host memory for evicted KV (0: no host tier)
    kv_disk_dir: str | None = None        # directory of the disk tier (None: none); kept across restarts
    kv_disk_size: int = 0                 # bytes the disk tier may hold (needed with kv_disk_dir)

    def validate(self) -> None:
        if self.block_size < 1:
            raise EngineConfigError(f"--block-size {self.block_size}: must be >= 1")
        if self.kv_host_memory < 0 or self.kv_disk_size < 0:
            raise EngineConfigError("--kv-host-memory and --kv-disk-size must be >= 0")
        if self.kv_disk_dir is not None and self.kv_disk_size <= 0:
            raise EngineConfigError(f"--kv-disk-dir {self.kv_disk_dir}: give the tier's bound with --kv-disk-size "
                                    "(e.g. 500GiB)")
        if self.kv_disk_size and self.kv_disk_dir is None:
            raise EngineConfigError("--kv-disk-size needs --kv-disk-dir (where the tier's files go)")
        if (self.kv_host_memory or self.kv_disk_dir is not None) and not self.enable_prefix_caching:
            raise EngineConfigError("--kv-host-memory / --kv-disk-dir keep prefix-cache blocks below the device "
                                    "pool: they need --enable-prefix-caching")
