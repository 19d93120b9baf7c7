"""The front's side of weight updates, the trainer's group, sleep and wake: each is one lock-step command to every
rank, answered by every rank (`AdminDone`), and settled as a future once all have answered.

What happens to the requests running when weights change is the caller's `policy` (`UPDATE_POLICIES`):
"drain" (the default) stops admitting, lets them finish on the old weights, then updates; "abort" ends them now
(finish_reason "abort"); "pause" applies the update at the next step boundary with their KV kept, and they go
on with the new weights. The drivers do the waiting (`LLM` steps, `AsyncEngine` awaits); this file keeps the
futures, the sleeping state (a request is refused while asleep: `EngineAsleepError`), and writes tensors given
in this process where every rank can read them (a private directory under /dev/shm: safetensors, no pickle).

It also keeps where the weights came from (`WeightOrigin`), which a lost rank's recovery needs: every recovery
path reads a checkpoint directory (a restarted job and a fresh rank the start-up checkpoint, the survivors'
reloaded expert slots the one each module last loaded whole). After a full `update_weights(path)` the front has
every rank load `path` again before the requests resume (`Front._resume`). After an update from memory
(tensors, a trainer's broadcast: their file is gone, or never was) no directory describes the weights, so a
recovery ends the requests in flight (finish_reason "abort", with the reason) instead of resuming them on a mix of
old and new weights, and refuses new ones (`WeightsLostError`) until an update carrying every tensor of the model
(from any source) restores them. Keeping each update's tensors as an overlay to re-apply was the alternative: it
would hold a copy of every tensor pushed since the last directory (a whole model's worth across RL steps) for an
event that may never come, where the trainer pushes a whole model next step anyway.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
import torch
from safetensors.torch import save_file

from moe_runtime.attention_dp.messages import (AdminDone, InitWeightUpdateGroup, Message, SleepEngine, UpdateWeights,
                                               WakeUpEngine)
from moe_runtime.engine.weight_update_group import GroupAddress, tensor_specs
from moe_runtime.engine.sleep_mode import ResidentMemory
from moe_runtime.engine.weight_updates import SlotChecksum
from moe_runtime.errors import EngineDeadError, InvalidRequestError, MoERuntimeError

UPDATE_POLICIES = ("drain", "abort", "pause")
SHARED_MEMORY = Path("/dev/shm")
ADMIN_TIMEOUT_S = 3600.0   # a blocking caller waits this long for every rank's answer (a large checkpoint's load)


class EngineAsleepError(InvalidRequestError):
    """A request reached an engine put to sleep (`sleep`); `wake_up` first."""


class WeightsBrokenError(MoERuntimeError):
    """An update failed while writing: the ranks hold a mix of old and new weights."""


class WeightsLostError(InvalidRequestError):
    """A request reached an engine whose weights a rank's loss left mixed (they came from memory since the last
    checkpoint directory); an update carrying every tensor of the model restores service."""


@dataclass(frozen=True)
class WeightOrigin:
    """Where the ranks' weights came from. `checkpoint`: the directory they last came from whole (the start-up
    checkpoint, or the last full `update_weights(path)`); `exact`: nothing changed them since (no update from
    memory, none that broke while writing), so a lost rank's weights can be read from `checkpoint` again."""

    checkpoint: str
    exact: bool = True


def check_policy(policy: str) -> str:
    if policy not in UPDATE_POLICIES:
        raise InvalidRequestError(f"policy: {policy!r} is not one of {list(UPDATE_POLICIES)}")
    return policy


def check_level(level: int) -> int:
    if level not in (1, 2):
        raise InvalidRequestError(f"level: {level!r}; sleep levels are 1 (free the KV pool, weights to host memory) "
                                  "and 2 (drop the weights too)")
    return level


@dataclass(frozen=True)
class AdminResult:
    """Every rank's answer to one command, by rank: its resident memory after it, the tensors it loaded and (when
    asked) its expert slots' checksums."""

    memory: dict[int, ResidentMemory]
    tensors: dict[int, int] = field(default_factory=dict)
    checksums: dict[int, list[SlotChecksum]] = field(default_factory=dict)
    complete: bool = False   # an update that carried every tensor of the model (on every rank)

    @classmethod
    def of(cls, answers: list[AdminDone]) -> "AdminResult":
        """The result, or the first rank's error: `WeightsBrokenError` if the weights are mixed, else
        `InvalidRequestError` (nothing was changed)."""
        answers = sorted(answers, key=lambda a: a.rank)
        broken = [a for a in answers if a.broken]
        if broken:
            raise WeightsBrokenError(f"rank {broken[0].rank}: {broken[0].error}")
        refused = [a for a in answers if a.error is not None]
        if refused:
            raise InvalidRequestError(f"rank {refused[0].rank}: {refused[0].error}")
        return cls({a.rank: a.memory for a in answers}, {a.rank: a.tensors for a in answers},
                   {a.rank: list(a.checksums) for a in answers if a.checksums}, all(a.complete for a in answers))


@dataclass
class _Pending:
    command: Message
    future: concurrent.futures.Future
    expected: int
    answers: list[AdminDone]
    after: Callable[[AdminResult], None] | None


class AdminRequests:
    """The admin commands in flight (one at a time: `send` refuses a second while one is in flight), whether
    the engine sleeps, where its weights came from, and whether a rank's loss lost them (`weights_lost`: why).
    `checkpoint`: the start-up checkpoint."""

    def __init__(self, checkpoint: str):
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.sleep_level = 0
        self.origin = WeightOrigin(str(checkpoint))
        self.weights_lost: str | None = None

    def next_id(self) -> int:
        return next(self._ids)

    @property
    def busy(self) -> bool:
        return any(not p.future.done() for p in self._pending.values())

    def send(self, command: Message, send: Callable[[Message], None], world_size: int,
             after: Callable[[AdminResult], None] | None = None) -> concurrent.futures.Future:
        """Send `command` to every rank; a future of its `AdminResult` (or its error). `after(result)` runs on
        success before the future is settled."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(command, UpdateWeights) and self.weights_lost is not None:
            command = msgspec.structs.replace(command, whole=True)   # only every tensor restores lost weights
        self._pending[command.update_id] = _Pending(command, future, world_size, [], after)
        try:
            send(command)
        except BaseException:
            self._pending.pop(command.update_id, None)
            raise
        return future

    def check_admission(self) -> None:
        if self.sleep_level:
            raise EngineAsleepError(f"the engine is asleep (sleep level {self.sleep_level}): wake_up first")
        if self.weights_lost is not None:
            raise WeightsLostError(self.weights_lost)

    def lose_weights(self, why: str) -> str:
        """A recovery cannot give the weights back (`why`): refuse requests until a full update; the reason."""
        self.weights_lost = (f"{why}; requests are refused until an update carrying every tensor of the model "
                             "(update_weights(path), or tensors / a trainer's broadcast of all of them)")
        return self.weights_lost

    def _note(self, command: Message, result: AdminResult | None, error: Exception | None) -> None:
        """What a settled command tells of where the weights came from."""
        if isinstance(command, UpdateWeights):
            if error is not None:
                if isinstance(error, WeightsBrokenError):
                    self.origin = dataclasses.replace(self.origin, exact=False)
                return
            if command.path and not command.partial and not command.specs:   # a directory, whole
                self.origin = WeightOrigin(command.path)
            else:
                self.origin = dataclasses.replace(self.origin, exact=False)
            if result.complete:
                self.weights_lost = None
        elif isinstance(command, WakeUpEngine) and command.reload and error is None and self.weights_lost is None:
            self.origin = dataclasses.replace(self.origin, exact=True)   # the checkpoint loaded whole again

    def take(self, message) -> bool:
        if not isinstance(message, AdminDone):
            return False
        pending = self._pending.get(message.update_id)
        if pending is None:
            return True
        pending.answers.append(message)
        if len(pending.answers) == pending.expected:
            del self._pending[message.update_id]
            try:
                result = AdminResult.of(pending.answers)
                self._note(pending.command, result, None)
                if pending.after is not None:
                    pending.after(result)
            except MoERuntimeError as exc:
                self._note(pending.command, None, exc)
                pending.future.set_exception(exc)
            else:
                pending.future.set_result(result)
        return True

    def fail(self, reason: str) -> None:
        for pending in self._pending.values():
            if isinstance(pending.command, UpdateWeights):   # some ranks may have applied it
                self.origin = dataclasses.replace(self.origin, exact=False)
            if not pending.future.done():
                pending.future.set_exception(EngineDeadError(reason))
        self._pending.clear()


def write_tensors(named_tensors) -> Path:
    """The tensors as a safetensors file in a new private directory (under /dev/shm where there is one), for every
    rank to read; the caller removes it (`remove_written`). Tensors sharing memory (tied weights) are copied apart."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    for name, tensor in items:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidRequestError("named_tensors: (name, tensor) pairs or a {name: tensor} dict")
        if name in tensors:
            raise InvalidRequestError(f"named_tensors: tensor {name!r} given twice")
        host = tensor.detach().to("cpu").contiguous()
        if host.untyped_storage().data_ptr() in seen:
            host = host.clone()
        seen.add(host.untyped_storage().data_ptr())
        tensors[name] = host
    if not tensors:
        raise InvalidRequestError("named_tensors: no tensor given")
    root = SHARED_MEMORY if SHARED_MEMORY.is_dir() else None
    directory = Path(tempfile.mkdtemp(prefix="moe-runtime-weights-", dir=root))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def remove_written(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


# ---- the commands, as the drivers send them (`Front.admin_command(make)`: make(update_id) -> the command) -------
def disk_update(path: str, checksums: bool = False, partial: bool = False) -> Callable[[int], Message]:
    if not isinstance(path, (str, Path)) or not str(path):
        raise InvalidRequestError("path: a checkpoint directory is required")
    return lambda update_id: UpdateWeights(update_id=update_id, path=str(path), partial=partial, checksums=checksums)


def distributed_update(names: list[str], dtypes: list[str], shapes: list[list[int]],
                       checksums: bool = False) -> Callable[[int], Message]:
    specs = tensor_specs(list(names), list(dtypes), [list(s) for s in shapes])
    if not specs:
        raise InvalidRequestError("names: no tensor given")
    return lambda update_id: UpdateWeights(update_id=update_id, specs=specs, checksums=checksums)


def group_join(address: GroupAddress, world_size: int) -> Callable[[int], Message]:
    address.check(world_size)
    return lambda update_id: InitWeightUpdateGroup(update_id=update_id, address=address)


def sleep_command(level: int) -> Callable[[int], Message]:
    check_level(level)
    return lambda update_id: SleepEngine(update_id=update_id, level=level)


def wake_command(reload: bool) -> Callable[[int], Message]:
    return lambda update_id: WakeUpEngine(update_id=update_id, reload=bool(reload))
