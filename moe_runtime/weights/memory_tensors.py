"""Tensors held in memory, read through `CheckpointReader` as if they were one safetensors file.

A weight update from tensors (the same process, or a trainer's broadcast) reaches the model through the loaders
that read checkpoints: every module reads its own shard, its own experts (replicas included) and quantizes what
it keeps quantized exactly as at start-up. The reader only needs the few calls of a `safe_open` handle that it
makes (`get_tensor`, `get_slice` with its shape, dtype and slicing), which `MemoryTensors` answers from a dict.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moe_runtime.config.multimodal_wrappers import wrapper_of
from moe_runtime.weights.checkpoint import CheckpointReader

MEMORY_FILE = "<memory>"   # the one "file" every in-memory tensor is listed in

# safetensors' dtype names, as `get_slice(...).get_dtype()` says them (the reader asks for FP8 and int8 by name)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16",
                      torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


class MemorySlice:
    """What `get_slice(name)` of a safetensors handle answers: shape, dtype, and indexing."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return SAFETENSORS_DTYPES.get(self.tensor.dtype, str(self.tensor.dtype))

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


class MemoryTensors:
    """A dict of named CPU or device tensors behind a safetensors handle's face."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> MemorySlice:
        return MemorySlice(self.tensors[name])


def memory_reader(tensors: dict[str, torch.Tensor], hf_config, label: str = "the update's tensors") -> CheckpointReader:
    """A reader of `tensors` named as the served model's checkpoint names them (transformers' names). A
    multimodal wrapper's text model reads its tensors under the wrapper's prefix, as from its checkpoint. The
    tensors are taken as plain (dequantized) weights: a module kept quantized quantizes them as it loads."""
    reader = CheckpointReader(Path(label), {name: MEMORY_FILE for name in tensors})
    reader._handles[MEMORY_FILE] = MemoryTensors(tensors)
    return as_plain_tensors(reader, hf_config)


def plain_reader(directory: Path, hf_config) -> CheckpointReader:
    """A safetensors directory of plain tensors (those an update from tensors wrote for the ranks), read lazily as
    `memory_reader` reads tensors: the served model's quantization config is not applied to them."""
    return as_plain_tensors(CheckpointReader.open(directory), hf_config)


def as_plain_tensors(reader: CheckpointReader, hf_config) -> CheckpointReader:
    reader.hf_config = hf_config
    reader.plain_tensors = True
    wrapper = wrapper_of(hf_config) if hf_config is not None else None
    if wrapper is not None:
        reader.renamed(wrapper.rename)
    return reader
