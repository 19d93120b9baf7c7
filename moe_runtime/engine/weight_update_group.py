"""The process group a trainer pushes new weights through: the trainer is its rank 0, each engine rank one more.

It is a group of its own (its own TCP store at the trainer's address, not the engine's world): the engine's
collectives and the trainer's never meet. For each update the engine ranks first check the `TensorSpec`s against
the served model and agree, then one all-reduce over the group tells the trainer the verdict (`send` raises
`EngineRefusedUpdate` on a refusal, sending nothing). Accepted, the trainer broadcasts each tensor whole, in the
order both sides were told; every engine rank receives them in batches of whole modules, loading what it holds of
each batch before the next (`weight_updates.py`). gloo carries CPU tensors (and any device: received on the host,
then copied); nccl carries device tensors. The group is unauthenticated torch.distributed: private networks only
(docs/security.md).

`TrainerWeightSender` is the trainer's half (rank 0); `WeightUpdateGroup` the engine rank's.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from moe_runtime.errors import InvalidRequestError

BACKENDS = ("gloo", "nccl")
JOIN_TIMEOUT_S = 60.0   # an engine rank waits this long for the trainer (to join, in each broadcast): no request
# steps meanwhile, so an address where no trainer listens must not freeze the engine for long


@dataclass(frozen=True)
class GroupAddress:
    """Where the trainer serves the group's store and who is in it (SGLang's `init_weights_update_group` names)."""

    master_address: str
    master_port: int
    rank_offset: int      # engine rank r is group rank rank_offset + r (the trainer is rank 0)
    world_size: int       # the trainer and every engine rank
    group_name: str = "weight_update"
    backend: str = "gloo"
    timeout_s: float = JOIN_TIMEOUT_S

    def check(self, engine_ranks: int) -> None:
        """InvalidRequestError naming the field that cannot describe a group of the trainer and `engine_ranks`."""
        if self.backend not in BACKENDS:
            raise InvalidRequestError(f"backend: {self.backend!r} is not one of {list(BACKENDS)}")
        if not 0 < self.master_port < 65536:
            raise InvalidRequestError(f"master_port: {self.master_port} is no TCP port")
        if self.rank_offset < 1:
            raise InvalidRequestError(f"rank_offset: {self.rank_offset}; the trainer is rank 0, the engine's ranks "
                                      "follow it (at least 1)")
        if self.rank_offset + engine_ranks > self.world_size:
            raise InvalidRequestError(f"world_size: {self.world_size} cannot hold the engine's {engine_ranks} rank(s) "
                                      f"from rank_offset {self.rank_offset}")
        if not self.group_name:
            raise InvalidRequestError("group_name: empty")
        if not 0 < self.timeout_s <= 3600:
            raise InvalidRequestError(f"timeout_s: {self.timeout_s}; seconds the ranks wait for the trainer, in (0, 3600]")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the trainer broadcasts: its name (transformers'), dtype (torch's name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidRequestError(f"dtypes: {self.dtype!r} (tensor {self.name!r}) is not a torch dtype")
        return dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def tensor_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorSpec]:
    """The specs of an `update_weights_from_distributed` call, checked: InvalidRequestError naming the field."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise InvalidRequestError(f"names, dtypes, shapes: {len(names)}, {len(dtypes)} and {len(shapes)} entries; "
                                  "one of each per tensor")
    if len(set(names)) != len(names):
        raise InvalidRequestError("names: a tensor is named twice")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if any(int(d) < 0 for d in shape):
            raise InvalidRequestError(f"shapes: {list(shape)} (tensor {name!r}) has a negative dimension")
        spec = TensorSpec(str(name), str(dtype).removeprefix("torch."), tuple(int(d) for d in shape))
        spec.torch_dtype()
        specs.append(spec)
    return specs


def _process_group(address: GroupAddress, rank: int, is_master: bool):
    timeout = datetime.timedelta(seconds=address.timeout_s)
    store = dist.TCPStore(address.master_address, address.master_port, address.world_size, is_master=is_master,
                          timeout=timeout)
    prefixed = dist.PrefixStore(address.group_name, store)
    if address.backend == "nccl":
        return store, dist.ProcessGroupNCCL(prefixed, rank, address.world_size)
    return store, dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)


class EngineRefusedUpdate(InvalidRequestError):
    """The engine refused the update before receiving anything (its reason is in its answer to the
    `update_weights_from_distributed` call, and in its ranks' logs); the trainer sent nothing."""


def _verdict(group, refused: bool, device: torch.device) -> bool:
    """Whether any member refuses the update: one all-reduce (MAX) over the group. The engine's ranks agreed on
    theirs already; the trainer contributes 0 and learns it before it broadcasts anything."""
    flag = torch.tensor([int(refused)], dtype=torch.int64, device=device)
    group.allreduce([flag], _max_options()).wait()
    return bool(flag.item())


def _max_options():
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    return options


class WeightUpdateGroup:
    """An engine rank's membership: `verdict`, then `receive` the trainer's broadcasts of one update."""

    def __init__(self, address: GroupAddress, engine_rank: int, device: torch.device):
        self.address = address
        self.rank = address.rank_offset + engine_rank
        self.device = device
        self._store, self._group = _process_group(address, self.rank, is_master=False)

    def _on(self) -> torch.device:
        return self.device if self.address.backend == "nccl" else torch.device("cpu")

    def verdict(self, refusal: str | None) -> None:
        """Tell the trainer whether the update is received (`refusal`: why not, agreed by every engine rank):
        its `send` raises `EngineRefusedUpdate` on a refusal instead of broadcasting into a group nobody reads."""
        _verdict(self._group, refusal is not None, self._on())

    def receive(self, specs: list[TensorSpec], module_of: Callable[[str], str],
                batch_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors of `specs`, received whole in their order (the trainer broadcasts them so), handed over in
        batches of about `batch_bytes` that hold whole modules only (`module_of(name)`: the module a tensor loads
        with; a module loads its tensors together): the caller loads each before the next is received, so the
        update is never held whole (a module larger than `batch_bytes` is a batch of its own)."""
        on = self._on()
        left: dict[str, int] = {}
        for spec in specs:
            left[module_of(spec.name)] = left.get(module_of(spec.name), 0) + 1
        batch: dict[str, torch.Tensor] = {}
        size, open_modules = 0, set()
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=spec.torch_dtype(), device=on)
            self._group.broadcast(tensor, 0).wait()
            batch[spec.name] = tensor
            size += tensor.numel() * tensor.element_size()
            module = module_of(spec.name)
            left[module] -= 1
            if left[module]:
                open_modules.add(module)
            else:
                open_modules.discard(module)
            if size >= batch_bytes and not open_modules:
                yield batch
                batch, size = {}, 0
        if batch:
            yield batch

    def destroy(self) -> None:
        """Leave the group (its sockets and threads): on a re-join and at shutdown."""
        shutdown = getattr(self._group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:   # already torn down (a member left)
                pass
        self._group = self._store = None


class TrainerWeightSender:
    """The trainer's half (group rank 0, the store's host): construct it while the engine joins
    (`init_weights_update_group`), then `send` the tensors of each `update_weights_from_distributed` call."""

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str = "weight_update",
                 backend: str = "gloo", timeout_s: float = 300.0):
        self.address = GroupAddress(master_address, master_port, 1, world_size, group_name, backend, timeout_s)
        self._store, self._group = _process_group(self.address, 0, is_master=True)

    @staticmethod
    def specs(named_tensors: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
        return [TensorSpec.of(name, tensor) for name, tensor in named_tensors]

    def send(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Wait for the engine's verdict on the update (it checks the names, shapes and dtypes first: up to
        `timeout_s`, which must cover its drain policy's wait), then broadcast every tensor. EngineRefusedUpdate
        when it refused (nothing sent)."""
        device = named_tensors[0][1].device if self.address.backend == "nccl" and named_tensors else torch.device("cpu")
        if _verdict(self._group, False, device):
            raise EngineRefusedUpdate("the engine refused the update before receiving it (its reason is in its "
                                      "answer to update_weights_from_distributed); nothing was sent")
        for _, tensor in named_tensors:
            self._group.broadcast(tensor.detach().contiguous(), 0).wait()
