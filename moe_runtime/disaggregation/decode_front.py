"""A decode instance's front half of KV transfers: admit imports, settle them, release the prefill's copy.

An import is admitted like a request (the same limits), after its handle's signature and prompt
digest are checked: nothing connects anywhere for a handle this deployment did not make. Its first
token (sampled by the prefill instance) is output at once. Each rank of the chosen worker reports
when its pull ended (`landed`); when all have their KV the front activates the request on every
rank. When a pull failed on any rank, or the timeout passed first (the prefill instance or one of its ranks
died, its link is down, the two layouts cannot meet), the request is computed here instead: the front
aborts the import on every rank and sends the request again with its first token as its tokens so far,
recomputed as after a preemption (`ImportOutcome.recompute`); only a failure that would recur here (its
grammar) fails the request alone. Either way the prefill instance is told to free its parked copy
(fire-and-forget: its own timeout is the backstop). When the decode instance's own ranks re-form or
restart, every import in flight is `abandon`ed alike and resumed with the other requests.

A handle is good for one request: `claim` checks its signature and expiry and takes its nonce (a
second use is refused before anything connects). A claimed handle whose request is then refused
(its limits, its prompt, max_tokens < 2, a full queue, a dead engine) is `refuse`d: the prefill
instance frees its copy at once instead of at its timeout. Only a handle this front claimed, or
can still claim, is released that way, so a replayed copy cannot free blocks another import pulls.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from moe_runtime.errors import InvalidRequestError
from moe_runtime.disaggregation.kv_transfer.handle import HandleError, KVHandle
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.release import ReleaseSender
from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.disaggregation.kv_transfer.used_nonces import NonceRefused, UsedNonces
from moe_runtime.sampling.params import SamplingParams

SETTLE_GRACE_S = 5.0   # past the ranks' own pull timeout, how long the front waits for their reports


@dataclass
class ImportInFlight:
    request_id: str
    dp_rank: int
    waiting_ranks: set[int]                  # ranks of the worker that have not reported yet
    handle: KVHandle
    deadline: float
    num_bytes: int = 0
    seconds: float = 0.0                     # the slowest rank's pull


@dataclass(frozen=True)
class ImportOutcome:
    request_id: str
    dp_rank: int
    error: str | None                        # None: every rank has the KV, activate it
    recompute: bool = False                  # after an error: compute the prompt here instead of failing


@dataclass
class DecodeFront:
    key: TransferKey
    timeout_s: float
    stats: TransferStats
    sender: ReleaseSender = field(init=False)
    nonces: UsedNonces = field(default_factory=UsedNonces)
    _imports: dict[str, ImportInFlight] = field(default_factory=dict)
    _claimed: dict[str, KVHandle] = field(default_factory=dict)    # nonce -> handle claimed, import not started
    _lock: threading.Lock = field(default_factory=threading.Lock)  # `claim`/`refuse` may run in worker threads

    def __post_init__(self) -> None:
        self.sender = ReleaseSender(self.key)

    def claim(self, handle: KVHandle) -> KVHandle:
        """`handle`, if this deployment's prefill instance signed it, it has not expired and it was not used
        before (its nonce is taken now); else `HandleError`, and nothing was connected to."""
        handle.authentic(self.key)
        with self._lock:
            try:
                self.nonces.use(handle.nonce, handle.expires_at)
            except NonceRefused as exc:
                raise HandleError(f"kv_transfer_params refused: {exc} (a KV handle is good for one request)") from exc
            self._claimed[handle.nonce] = handle
        return handle

    def check_fits(self, handle: KVHandle, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """`InvalidRequestError` unless `handle` is for this prompt and the request wants more than the token
        the prefill sampled."""
        if params.max_tokens < 2:
            raise InvalidRequestError(f"max_tokens={params.max_tokens}: a request continued from a prefill instance "
                                      f"generates at least 2 tokens (the prefill sampled the first)")
        handle.check_prompt(prompt_token_ids)

    def verify(self, handle: KVHandle, prompt_token_ids: list[int], params: SamplingParams) -> KVHandle:
        """`claim` and `check_fits`; a claimed handle that does not fit is `refuse`d (its KV freed at once)."""
        handle = self.claim(handle)
        try:
            self.check_fits(handle, prompt_token_ids, params)
        except InvalidRequestError:
            self.refuse(handle)
            raise
        return handle

    def refuse(self, handle: KVHandle) -> bool:
        """The request that came with `handle` was refused (or never reached the front): tell its prefill
        instance to free the parked copy now. Only for a handle claimed here and not started, or one still
        claimable (authentic, unexpired, unused: it is claimed now); any other is left alone. Whether a
        release was sent."""
        with self._lock:
            claimed = self._claimed.get(handle.nonce) is handle    # this request's claim, not a replayed copy's
            if claimed:
                del self._claimed[handle.nonce]
        if not claimed:
            try:
                self.claim(handle)
            except HandleError:
                return False
            with self._lock:
                self._claimed.pop(handle.nonce, None)
        self.sender.send(handle.release_endpoint, handle.request_id)
        return True

    def compute_here(self, handle: KVHandle) -> KVHandle:
        """A claimed import admitted while this instance's ranks recover: it will not be pulled (its request resumes
        from its first token with the others), so its prefill instance frees its copy now."""
        self.refuse(handle)
        self.stats.recomputed += 1
        return handle

    def start(self, request_id: str, dp_rank: int, ranks: set[int], handle: KVHandle) -> None:
        with self._lock:
            self._claimed.pop(handle.nonce, None)
        self._imports[request_id] = ImportInFlight(request_id, dp_rank, set(ranks), handle,
                                                   time.monotonic() + self.timeout_s + SETTLE_GRACE_S)

    def landed(self, rank: int, request_id: str, error: str | None, num_bytes: int, seconds: float,
               recomputable: bool = False) -> ImportOutcome | None:
        """A rank's pull ended; the outcome once the import is settled (None while ranks are still pulling)."""
        entry = self._imports.get(request_id)
        if entry is None or rank not in entry.waiting_ranks:
            return None
        if error is not None:
            return self._settle(entry, f"KV transfer from the prefill instance failed: {error}", recomputable)
        entry.waiting_ranks.discard(rank)
        entry.num_bytes += num_bytes
        entry.seconds = max(entry.seconds, seconds)
        return self._settle(entry, None) if not entry.waiting_ranks else None

    def take_expired(self) -> list[ImportOutcome]:
        now = time.monotonic()
        return [self._settle(entry, f"KV transfer from the prefill instance timed out ({self.timeout_s:g}s)", True)
                for entry in list(self._imports.values()) if entry.deadline <= now]

    def abandon(self) -> list[str]:
        """The decode instance's ranks were lost: no import in flight will land (the front resumes their requests
        from their first token). Release every prefill copy; the requests' ids."""
        abandoned = list(self._imports)
        for request_id in abandoned:
            self.release(request_id)
        self.stats.recomputed += len(abandoned)
        return abandoned

    def release(self, request_id: str) -> bool:
        """The request ended here before its import settled (client gone, stop string): release the prefill's copy."""
        entry = self._imports.pop(request_id, None)
        if entry is not None:
            self.sender.send(entry.handle.release_endpoint, entry.handle.request_id)
        return entry is not None

    def _settle(self, entry: ImportInFlight, error: str | None, recompute: bool = False) -> ImportOutcome:
        del self._imports[entry.request_id]
        self.sender.send(entry.handle.release_endpoint, entry.handle.request_id)
        if error is None:
            self.stats.transfers += 1
            self.stats.bytes += entry.num_bytes
            self.stats.seconds.observe(entry.seconds)
        elif recompute:
            self.stats.recomputed += 1
        else:
            self.stats.failures += 1
        return ImportOutcome(entry.request_id, entry.dp_rank, error, recompute)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._imports

    @property
    def num_in_flight(self) -> int:
        return len(self._imports)

    @property
    def next_deadline(self) -> float | None:
        return min((entry.deadline for entry in self._imports.values()), default=None)

    def close(self) -> None:
        self.sender.close()
