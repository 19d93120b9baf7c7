"""Read tensors from an HF checkpoint directory (single or sharded safetensors), lazily.

Only the tensors a rank asks for are read: expert parallelism asks for a subset of experts.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from moe_runtime.errors import CheckpointError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class CheckpointReader:
    """Maps tensor names to the safetensors file holding them; opens files on demand."""

    directory: Path
    tensor_to_file: dict[str, str]
    _handles: dict[str, object] = field(default_factory=dict, repr=False)
    bytes_read: int = 0
    tensors_read: int = 0

    @classmethod
    def open(cls, directory: str | Path) -> "CheckpointReader":
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint directory {directory} does not exist")
        index_path = directory / INDEX_FILE
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index_path} is not a valid safetensors index: {exc}") from exc
            for file_name in sorted(set(weight_map.values())):
                if not (directory / file_name).exists():
                    raise CheckpointError(f"{index_path} lists shard {file_name}, which is missing from {directory}")
            return cls(directory, dict(weight_map))
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors weights (nor {INDEX_FILE}) in {directory}")
        tensor_to_file: dict[str, str] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensor_to_file[name] = path.name
        return cls(directory, tensor_to_file)

    def has(self, name: str) -> bool:
        return name in self.tensor_to_file

    def names(self) -> list[str]:
        return list(self.tensor_to_file)

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._handle(name)
        return tuple(handle.get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        handle = self._handle(name)
        tensor = handle.get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        self.tensors_read += 1
        return tensor

    def _handle(self, name: str):
        file_name = self.tensor_to_file.get(name)
        if file_name is None:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {self.directory}")
        handle = self._handles.get(file_name)
        if handle is None:
            path = self.directory / file_name
            if not path.exists():
                raise CheckpointError(f"weight file {path} is missing")
            handle = safe_open(str(path), framework="pt")
            self._handles[file_name] = handle
        return handle


def read_rows(reader: CheckpointReader, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of dim 0 of a tensor, without reading the rest (fused expert tensors)."""
    return read_slice(reader, name, 0, start, stop)


def read_slice(reader: CheckpointReader, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
    """[start, stop) along `dim` (0 or 1) of a tensor, reading only that part (tensor-parallel shards)."""
    handle = reader._handle(name)
    view = handle.get_slice(name)
    tensor = view[start:stop] if dim == 0 else view[:, start:stop]
    reader.bytes_read += tensor.numel() * tensor.element_size()
    reader.tensors_read += 1
    return tensor
