"""Sleep and wake of one rank's engine core: give the memory back while a trainer uses the machine.

Level 1 frees the KV pool and moves the weights off the accelerator into pinned host memory (on a CPU engine the
weights already live there and stay). Level 2 drops the weights too: a full weight update or `wake_up(reload)`
from the checkpoint brings them back. `wake_up` restores the pool (zeroed, as at start-up: the prefix cache was
flushed, no block holds anything) and the weights moved to the host.

Tensors are freed in place, never replaced: every module and kernel that holds a parameter or a cache tensor keeps
holding the same object. A device tensor gets an empty storage, and its old shape back on wake; a host KV pool
(an anonymous memory map: `layers/kv_cache.zeroed`) has its pages handed back to the OS (`madvise(DONTNEED)`),
which reads them as zeros when touched again, so waking it costs nothing.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_runtime.errors import InvalidRequestError

MADV_DONTNEED = 4


@dataclass(frozen=True)
class ResidentMemory:
    """What one rank holds: bytes of its KV pool and of its weights where they live, and its process's RSS."""

    rank: int
    kv_cache_bytes: int        # the KV pool's tensors, backed by memory (0 while asleep)
    weight_bytes: int          # the parameters on the engine's device (on a CPU engine: in host memory)
    host_weight_bytes: int     # parameters moved to pinned host memory by sleep level 1 (a device engine)
    rss_bytes: int             # this process's resident set (/proc/self/statm)
    sleep_level: int = 0


def process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


@dataclass(frozen=True)
class _Kept:
    """A freed tensor's geometry, to give it a storage again."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class SleepMode:
    """A core's sleep state. `core`: an `EngineCore` (its runner's caches, model, device)."""

    def __init__(self, core):
        self.core = core
        self.level = 0
        self._freed_kv: dict[int, tuple[torch.Tensor, _Kept]] = {}    # id -> device KV tensor given an empty storage
        self._host_weights: list[tuple[torch.Tensor, torch.Tensor, _Kept]] = []   # (param, pinned copy, geometry)
        self._dropped: list[tuple[torch.Tensor, _Kept]] = []          # level 2: parameters without a storage

    @property
    def weights_dropped(self) -> bool:
        return bool(self._dropped)

    @property
    def weights_on_host(self) -> bool:
        """Level 1 on a device: the parameters' storages are empty, their values in pinned host copies."""
        return bool(self._host_weights)

    # ---- what is held -------------------------------------------------------------------------------
    def kv_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the KV pool (paged KV, recurrent and compressed states), each once."""
        caches = list(self.core.runner.caches) + list(self.core.runner.drafter_state_caches)
        seen, tensors = set(), []
        for cache in caches:
            for field in dataclasses.fields(cache):
                value = getattr(cache, field.name)
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    tensors.append(value)
        return tensors

    def memory(self, rank: int) -> ResidentMemory:
        kv = 0 if self.level else sum(_tensor_bytes(t) for t in self.kv_tensors())
        weights = sum(_tensor_bytes(p) for p in self.core.model.parameters())
        host = sum(_tensor_bytes(copy) for _, copy, _ in self._host_weights)
        return ResidentMemory(rank, kv, weights, host, process_rss_bytes(), self.level)

    # ---- sleep --------------------------------------------------------------------------------------
    def check_can_sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequestError(f"level: {level}; sleep levels are 1 (free the KV pool, weights to host "
                                      "memory) and 2 (drop the weights too)")
        if self.core.runner.capture is not None and self.core.device.type == "cuda":
            raise InvalidRequestError("sleep: captured decode graphs (--enable-torch-compile) read the KV pool at "
                                      "fixed addresses; sleep is not supported with them yet")
        if self.core.exports is not None or self.core.imports is not None:
            raise InvalidRequestError("sleep: a P/D instance's KV pool is registered for transfers; sleep is not "
                                      "supported with --disaggregation-mode")
        if self.core.has_unfinished():
            raise InvalidRequestError("sleep: requests are still running on this engine (the front drains or "
                                      "aborts them first)")

    def sleep(self, level: int) -> None:
        """Free the KV pool (both levels) and move (1) or drop (2) the weights. Deeper sleep from level 1 to 2
        drops the weights moved to the host."""
        self.check_can_sleep(level)
        if self.level == 0:
            self.core.reset_prefix_cache()   # nothing cached survives: the pool's contents are gone
            for tensor in self.kv_tensors():
                self._free_kv(tensor)
        if level == 1 and self.level == 0 and self.core.device.type != "cpu":
            self._move_weights_to_host()
        if level == 2 and not self._dropped:
            self._drop_weights()
        self.level = max(self.level, level)
        if self.core.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self._dropped:
            _return_freed_heap()

    def _free_kv(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            _discard_host_pages(tensor)
            return
        kept = _Kept(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        with torch.no_grad():
            tensor.set_(torch.empty(0, dtype=tensor.dtype, device=tensor.device).untyped_storage(), 0, (0,), (1,))
        self._freed_kv[id(tensor)] = (tensor, kept)

    def _move_weights_to_host(self) -> None:
        for param in self.core.model.parameters():
            kept = _Kept(tuple(param.shape), tuple(param.stride()), param.storage_offset())
            host = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, pin_memory=True)
            with torch.no_grad():
                host.copy_(param)
                param.set_(torch.empty(0, dtype=param.dtype, device=param.device).untyped_storage(), 0, (0,), (1,))
            self._host_weights.append((param, host, kept))

    def _drop_weights(self) -> None:
        device = self.core.device
        for param, _, kept in self._host_weights:   # level 1 to 2: the host copies go
            self._dropped.append((param, kept))
        self._host_weights = []
        moved = {id(p) for p, _ in self._dropped}
        for param in self.core.model.parameters():
            if id(param) in moved:
                continue
            kept = _Kept(tuple(param.shape), tuple(param.stride()), param.storage_offset())
            with torch.no_grad():
                param.set_(torch.empty(0, dtype=param.dtype, device=device).untyped_storage(), 0, (0,), (1,))
            self._dropped.append((param, kept))

    # ---- wake ---------------------------------------------------------------------------------------
    @contextmanager
    def weights_restored(self):
        """Give dropped parameters their shapes back (uninitialized) for a full weight load to fill inside the
        block. They count as dropped until it succeeds: if it fails they are dropped again, so a plain `wake_up`
        stays refused and no uninitialized memory is ever served as weights."""
        if not self._dropped:
            yield
            return
        device = self.core.device
        with torch.no_grad():
            for param, kept in self._dropped:
                fresh = torch.empty_strided(kept.shape, kept.stride, dtype=param.dtype, device=device)
                param.set_(fresh.untyped_storage(), 0, kept.shape, kept.stride)
        try:
            yield
        except BaseException:
            with torch.no_grad():
                for param, _ in self._dropped:
                    param.set_(torch.empty(0, dtype=param.dtype, device=device).untyped_storage(), 0, (0,), (1,))
            raise
        self._dropped = []

    def wake_up(self, reload) -> None:
        """Restore the pool and the weights. `reload()` loads the whole checkpoint: needed after level 2 unless a
        full weight update has brought the weights back meanwhile."""
        if self._dropped:
            if reload is None:
                raise InvalidRequestError("wake_up: the weights were dropped (sleep level 2) and no update brought "
                                          "them back: wake_up(reload=True) reloads them from the checkpoint")
            with self.weights_restored():
                reload()
        with torch.no_grad():
            for param, host, kept in self._host_weights:
                on_device = host.to(param.device if param.device.type != "meta" else self.core.device)
                param.set_(on_device.untyped_storage(), 0, kept.shape, kept.stride)
            for tensor, kept in self._freed_kv.values():
                fresh = torch.zeros(kept.shape, dtype=tensor.dtype, device=tensor.device)
                tensor.set_(fresh.untyped_storage(), 0, kept.shape, kept.stride)
        self._host_weights, self._freed_kv = [], {}
        self.level = 0


def _return_freed_heap() -> None:
    """glibc keeps freed heap memory for reuse (a tensor below its mmap threshold, which grows as large blocks are
    freed): `malloc_trim` hands it back, so the dropped weights leave the resident set."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


def _discard_host_pages(tensor: torch.Tensor) -> None:
    """Hand the whole pages of a host tensor's storage back to the OS (they read as zeros when touched again), and
    zero the bytes of partial pages at its ends: the tensor reads as zeros, as a fresh pool does."""
    storage = tensor.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes == 0:
        return
    page = mmap.PAGESIZE
    first = -(-start // page) * page
    last = (start + nbytes) // page * page
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)   # [nbytes]: the storage's bytes
    with torch.no_grad():
        if last > first:
            if ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                                                         MADV_DONTNEED) != 0:
                flat.zero_()   # not handed back (not a private mapping): zero it at least
                return
            flat[: first - start].zero_()
            flat[last - start:].zero_()
        else:
            flat.zero_()
