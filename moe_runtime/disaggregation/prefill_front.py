"""A prefill instance's front half of KV transfers: hand out handles, decide when parked blocks are freed.

When a request added with `export_kv` finishes its prefill (its first token sampled, its blocks
parked on the ranks), the front signs a `KVHandle` for it: the prefilling worker's shards, the
first token, the sampler state. The parked blocks are freed (by a command every rank of the
worker applies at once) when the decode front says it has them (`ReleaseKV` on the listener), or at
the transfer timeout if it never does (a decode instance that died, a client that left before the
router passed the handle on).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.disaggregation.kv_transfer.handle import MAX_DRAFTS, HandleLogprob, KVHandle, prompt_digest
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.release import ReleaseListener
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.records.outputs import KVExportInfo, RequestOutput, TokenDelta


@dataclass(frozen=True)
class ParkedExport:
    request_id: str
    dp_rank: int          # the worker whose ranks hold the blocks
    deadline: float       # time.monotonic() after which they are freed anyway


class PrefillFront:
    def __init__(self, key: TransferKey, host: str, timeout_s: float, stats: TransferStats):
        self.key = key
        self.timeout_s = timeout_s
        self.stats = stats
        self.wake: Callable[[], None] | None = None      # called from the listener's thread on each release
        self._lock = threading.Lock()
        self._released: list[str] = []                   # request ids the decode side released (listener thread)
        self._parked: dict[str, ParkedExport] = {}
        self.listener = ReleaseListener(key, host, self._on_release)

    def handle_for(self, request_id: str, dp_rank: int, prompt_token_ids: list[int], first_token: int,
                   first_logprob: TokenLogprob | None, export: KVExportInfo, shards: list[KVShard]) -> KVHandle:
        """Sign the handle of a request whose blocks the ranks of worker `dp_rank` just parked."""
        self._parked[request_id] = ParkedExport(request_id, dp_rank, time.monotonic() + self.timeout_s)
        self.stats.exports += 1
        return KVHandle(request_id=request_id, num_tokens=export.num_tokens,
                        prompt_digest=prompt_digest(prompt_token_ids), first_token=first_token,
                        first_logprob=HandleLogprob.of(first_logprob) if first_logprob is not None else None,
                        first_drafts=list(export.drafts[:MAX_DRAFTS]), shards=shards,
                        release_endpoint=self.listener.endpoint, nonce=KVHandle.new_nonce(),
                        expires_at=time.time() + self.timeout_s).signed(self.key)

    def take_due(self) -> list[ParkedExport]:
        """Parked requests to free now: released by their decode instance, or past their deadline."""
        with self._lock:
            released, self._released = self._released, []
        due = []
        for request_id in released:
            parked = self._parked.pop(request_id, None)
            if parked is not None:
                self.stats.exports_released += 1
                due.append(parked)
        now = time.monotonic()
        for parked in [p for p in self._parked.values() if p.deadline <= now]:
            del self._parked[parked.request_id]
            self.stats.exports_expired += 1
            due.append(parked)
        return due

    def forget_all(self) -> int:
        """The instance's ranks were lost: what they parked is gone (restarted) or freed (re-formed: the ranks free
        it themselves), and a decode instance still pulling it computes the prompt itself. How many were parked."""
        lost = len(self._parked)
        self._parked.clear()
        return lost

    def forget(self, request_id: str) -> ParkedExport | None:
        """The front frees it itself (the output processor ended the request: it needs no decode)."""
        return self._parked.pop(request_id, None)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def next_deadline(self) -> float | None:
        """When the earliest parked request is freed anyway (time.monotonic()); None: nothing parked."""
        return min((p.deadline for p in self._parked.values()), default=None)

    def _on_release(self, request_id: str) -> None:
        with self._lock:
            self._released.append(request_id)
        if self.wake is not None:
            self.wake()

    def close(self) -> None:
        self.listener.close()


def note_step_deltas(front: PrefillFront | None, stats: TransferStats, dp_rank: int, deltas: list[TokenDelta],
                     outputs: list[RequestOutput], shards: Callable[[], list[KVShard]],
                     release: Callable[[str], None]) -> None:
    """Queue times; and, on a prefill instance, a handle on the last output of each request worker
    `dp_rank` parked (`shards()`: that worker's KV shards). A parked request that ended here (a stop
    string in its first token, an abort) needs no decode instance: `release(request_id)` frees it."""
    for delta in deltas:
        if delta.queue_seconds is not None:
            stats.queue_seconds.observe(delta.queue_seconds)
    parked = {d.request_id: d for d in deltas if d.kv_export is not None}
    if not parked:
        return
    for output in outputs:
        delta = parked.pop(output.request_id, None)
        if delta is not None and output.finish_reason == "length" and front is not None:
            output.kv_handle = front.handle_for(
                output.request_id, dp_rank, output.prompt_token_ids, delta.new_token_ids[0],
                delta.new_logprobs[0] if delta.new_logprobs else None, delta.kv_export, shards())
    for request_id in parked:
        release(request_id)
