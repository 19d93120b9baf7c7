"""The process group a trainer pushes new weights through: the trainer is its rank 0, each engine rank one more.

It is a group of its own (its own TCP store at the trainer's address, not the engine's world): the engine's
collectives and the trainer's never meet. The trainer broadcasts each tensor whole, in the order both sides were
told (`TensorSpec`s); every engine rank receives it and keeps only what it holds (`weight_updates.py`). gloo
carries CPU tensors (and any device: received on the host, then copied); nccl carries device tensors.

`TrainerWeightSender` is the trainer's half (rank 0); `WeightUpdateGroup` the engine rank's.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_runtime.errors import InvalidRequestError

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupAddress:
    """Where the trainer serves the group's store and who is in it (SGLang's `init_weights_update_group` names)."""

    master_address: str
    master_port: int
    rank_offset: int      # engine rank r is group rank rank_offset + r (the trainer is rank 0)
    world_size: int       # the trainer and every engine rank
    group_name: str = "weight_update"
    backend: str = "gloo"
    timeout_s: float = 300.0

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


class WeightUpdateGroup:
    """An engine rank's membership: `receive` takes the trainer's broadcasts of one update."""

    def __init__(self, address: GroupAddress, engine_rank: int, device: torch.device):
        self.address = address
        self.rank = address.rank_offset + engine_rank
        self.device = device
        self._store, self._group = _process_group(address, self.rank, is_master=False)

    def receive(self, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """Every tensor of `specs`, whole, in their order (the trainer broadcasts them so)."""
        on = self.device if self.address.backend == "nccl" else torch.device("cpu")
        received = {}
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=spec.torch_dtype(), device=on)
            self._group.broadcast(tensor, 0).wait()
            received[spec.name] = tensor
        return received


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
        for _, tensor in named_tensors:
            self._group.broadcast(tensor.detach().contiguous(), 0).wait()
