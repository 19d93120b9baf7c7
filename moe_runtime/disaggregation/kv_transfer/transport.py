"""The seam between the engine and how KV blocks move: a source of parked blocks, a sink that pulls them.

The engine sees only these Protocols. The implementation here is ZeroMQ over TCP with CURVE
(`block_server.KVBlockServer`, `puller.KVPuller`): it works between any two machines and on CPU, and
keeps a transfer off the lock-step loop's thread. On GPUs a NIXL (RDMA, GPU memory registered
once) or NCCL point-to-point implementation plugs in here: the source would register its cache
tensors and answer the same pulls (`PullBlocks`: layers, heads, block range) with a descriptor
instead of bytes, the sink would read into its own blocks, and everything above (handles,
re-sharding plans, parking, releases, timeouts) stays as it is.
"""
from __future__ import annotations

from typing import Callable, Protocol

from moe_runtime.disaggregation.kv_transfer.block_server import KVBlockServer
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.puller import KVPuller, PullJob, PullResult
from moe_runtime.disaggregation.kv_transfer.registry import ExportRegistry
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.layers.kv_cache import LayerKVCache


class KVSource(Protocol):
    """A prefill rank's server of parked blocks (`shard` names its endpoint)."""

    shard: KVShard

    def close(self) -> None: ...


class KVSink(Protocol):
    """A decode rank's puller: writes each job's blocks, reports each outcome once."""

    def submit(self, job: PullJob) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def take_landed(self) -> list[PullResult]: ...
    def close(self) -> None: ...


def open_source(caches: list[LayerKVCache], shard: KVShard, registry: ExportRegistry, key: TransferKey,
                host: str) -> KVSource:
    return KVBlockServer(caches, shard, registry, key, host)


def open_sink(caches: list[LayerKVCache], shard: KVShard, key: TransferKey,
              on_landed: Callable[[], None] | None = None) -> KVSink:
    return KVPuller(caches, shard, key, on_landed)
