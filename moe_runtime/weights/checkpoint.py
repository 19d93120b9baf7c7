"""Read tensors from an HF checkpoint directory (single or sharded safetensors), lazily.

Only the tensors a rank asks for are read: expert parallelism asks for a subset of experts.
The reader records every tensor it hands out (`consumed`), so the loader can tell a tensor no
rank used (a layer the model does not know, a format it does not read) from one it did.
FP8 block-quantized weights come out dequantized to float32 with their `weight_scale_inv` (`read`),
or as FP8 values with row-expanded scales for `--quantization fp8` (`read_fp8_rows`); so do compressed-tensors'
float-quantized modules and fbgemm's row-wise FP8 (Llama 4 Maverick: quantization/fbgemm_fp8_format.py, whose
expert stacks `read_fp8_expert` reads one expert at a time).
MXFP4 expert stacks (gpt-oss: `<name>_blocks` / `<name>_scales`, quantization/mxfp4_format.py) are read
under their logical name `<name>`, dequantized exactly to transformers' parameter layout, or as their
stored bytes (`read_mxfp4_rows`) for `--quantization mxfp4`.
DeepSeek-V4's FP4 experts (an int8 `weight` with e8m0 block scales: quantization/deepseek_fp4_format.py) are read
dequantized exactly, or as their stored bytes (`read_fp4`), which are MXFP4's layout.
int4 linears (compressed-tensors pack-quantized, AWQ, GPTQ: quantization/int4_checkpoint.py) are read under
`<module>.weight` too: as `Int4Weight` (`read_int4`, what int4 experts are kept in), or dequantized (`read`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from moe_runtime.config.multimodal_wrappers import wrapper_of
from moe_runtime.errors import CheckpointError
from moe_runtime.weights.quantization.compressed_tensors_format import CompressedTensorsFormat, quantization_config_dict
from moe_runtime.weights.quantization.fbgemm_fp8_format import FbgemmFp8Format
from moe_runtime.weights.quantization.deepseek_fp4_format import PackedFp4, block_scales_as_float
from moe_runtime.weights.quantization.fp8_block import SCALE_SUFFIX, Fp8BlockFormat
from moe_runtime.weights.quantization.fp8_in_memory import (Fp8Rows, expand_block_scales, quantize_rows,
                                                             row_expanded_scales)
from moe_runtime.weights.quantization.int4_checkpoint import Int4Checkpoint
from moe_runtime.kernels.int4_layout import Int4Weight
from moe_runtime.weights.quantization.mxfp4_format import BLOCKS_SUFFIX, SCALES_SUFFIX, PackedMxfp4

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
    fp8: Fp8BlockFormat | None = None          # the checkpoint's FP8 block format; None = not quantized
    consumed: set[str] = field(default_factory=set, repr=False)
    # a checkpoint read under other names than stored (DeepSeek-V4's published names): name -> stored name
    stored_names: dict[str, str] = field(default_factory=dict, repr=False)
    renames: list = field(default_factory=list, repr=False)   # each `renamed` applied, in order (a slot reload too)
    # compressed-tensors: each quantized module's `weight` made from its stored parameters, which the
    # listing no longer shows (their files: `_parameter_files`)
    compressed: CompressedTensorsFormat | None = None
    _parameter_files: dict[str, str] = field(default_factory=dict, repr=False)
    int4: Int4Checkpoint | None = None         # the checkpoint's int4 modules (any of the three formats)
    hf_config: object = field(default=None, repr=False)   # what it was opened with (a slot reload opens it again)
    fbgemm: FbgemmFp8Format | None = None      # fbgemm row-wise FP8 (Llama 4 Maverick): `<name>` beside `<name>_scale`
    # an update's float tensors (weights/memory_tensors.py), not a release: a weight kept int4 rounds them as it
    # loads even where int4 was kept by itself (a trainer pushes float experts to an int4 release)
    plain_tensors: bool = False

    @classmethod
    def open(cls, directory: str | Path, fp8: Fp8BlockFormat | None = None, hf_config=None) -> "CheckpointReader":
        """`hf_config`: the served model's, when its checkpoint names tensors otherwise (a multimodal release's
        text model under its wrapper's prefix: read under the text model's names)."""
        reader = cls._open(Path(directory))
        reader.fp8 = fp8
        reader.hf_config = hf_config
        reader.fbgemm = FbgemmFp8Format.of(quantization_config_dict(hf_config), str(directory)) if hf_config else None
        wrapper = wrapper_of(hf_config) if hf_config is not None else None
        if wrapper is not None:
            reader.renamed(wrapper.rename)
        compressed = CompressedTensorsFormat.of(hf_config, reader.names(), str(directory)) if hf_config else None
        if compressed is not None:
            reader.compressed = compressed
            reader._list_as_weights({module.weight_name: list(module.params.values())
                                     for module in compressed.modules.values()})
        reader.int4 = Int4Checkpoint.of(hf_config, reader.names(), compressed, str(directory)) if hf_config else None
        if reader.int4 is not None and reader.int4.hides_parameters:
            reader._list_as_weights(reader.int4.stored_parameters())
        return reader

    def _list_as_weights(self, modules: dict[str, list[str]]) -> None:
        """List each packed module's `weight` (made from its stored parameters) instead of those parameters."""
        parameters = {stored for params in modules.values() for stored in params}
        self._parameter_files.update({name: self.tensor_to_file[name] for name in parameters})
        weights = {weight: self.tensor_to_file[params[0]] for weight, params in modules.items()}
        self.tensor_to_file = {name: file for name, file in self.tensor_to_file.items() if name not in parameters}
        self.tensor_to_file.update(weights)

    def _compressed_module(self, name: str):
        return self.compressed.modules.get(name) if self.compressed is not None else None

    def _int4_module(self, name: str):
        return self.int4.modules.get(name) if self.int4 is not None else None

    def int4_experts_layout(self):
        """The int4 layout the checkpoint's routed experts are stored in (None: they are not int4)."""
        return self.int4.experts_layout(str(self.directory)) if self.int4 is not None else None

    def read_int4(self, name: str) -> Int4Weight | None:
        """`<module>.weight` as stored in int4, unpacked into the int4 layout [N, K] (None: not stored in int4)."""
        module = self._int4_module(name)
        if module is None:
            return None
        weight = module.read(self._read_parameter)
        self.tensors_read += 1
        self.consumed.add(name)
        return weight

    def _parameter_handle(self, name: str):
        """The open file of a compressed module's stored parameter (not listed: the module's weight is)."""
        return self._file(self._parameter_files[name])

    def _read_parameter(self, name: str) -> torch.Tensor:
        tensor = self._parameter_handle(name).get_tensor(self._stored(name))
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    @classmethod
    def _open(cls, directory: Path) -> "CheckpointReader":
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
            for name in _open_safetensors(path).keys():
                tensor_to_file[name] = path.name
        return cls(directory, tensor_to_file)

    def renamed(self, rename) -> None:
        """Read every tensor under `rename(stored name)` from now on (a model whose checkpoints come in another
        naming: each name the model reads, and each the loader reports unread, is the renamed one)."""
        current = {rename(name): name for name in self.tensor_to_file}
        stored = {name: self._stored(old) for name, old in current.items()}   # through any earlier renames
        self.tensor_to_file = {name: self.tensor_to_file[old] for name, old in current.items()}
        self.stored_names = {name: original for name, original in stored.items() if name != original}
        self.renames.append(rename)

    def _stored(self, name: str) -> str:
        return self.stored_names.get(name, name)

    def has(self, name: str) -> bool:
        return name in self.tensor_to_file

    def is_mxfp4(self, name: str) -> bool:
        """Whether `name` is stored as an MXFP4 pair `<name>_blocks` / `<name>_scales` (and not as itself)."""
        return (name not in self.tensor_to_file and name + BLOCKS_SUFFIX in self.tensor_to_file
                and name + SCALES_SUFFIX in self.tensor_to_file)

    def read_mxfp4_rows(self, name: str, start: int | None = None, stop: int | None = None) -> PackedMxfp4:
        """Rows [start, stop) of dim 0 (experts) of an MXFP4 tensor, as stored: values [n, N, G*16], scales
        [n, N, G] (the whole tensor without start / stop)."""
        parts = []
        for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX):
            full = name + suffix
            view = self._handle(full).get_slice(self._stored(full))
            tensor = view[:] if start is None else view[start:stop]
            self._count(full, tensor)
            parts.append(tensor)
        return PackedMxfp4.from_stored(parts[0], parts[1], name)

    def names(self) -> list[str]:
        return list(self.tensor_to_file)

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._compressed_module(name)
        if module is not None:
            return module.shape(self._read_parameter, lambda stored: tuple(
                self._parameter_handle(stored).get_slice(self._stored(stored)).get_shape()))
        int4 = self._int4_module(name)
        if int4 is not None:
            return int4.shape(self._read_parameter, lambda stored: tuple(
                self._parameter_handle(stored).get_slice(self._stored(stored)).get_shape()))
        if self.is_mxfp4(name):   # the dequantized parameter layout [..., K, N]
            *lead, rows, groups, _ = self._handle(name + BLOCKS_SUFFIX).get_slice(self._stored(name + BLOCKS_SUFFIX)).get_shape()
            return (*lead, groups * 32, rows)
        if self.is_fp4(name):   # the dequantized [N, K]: two codes a byte
            rows, packed = self._handle(name).get_slice(self._stored(name)).get_shape()
            return (rows, packed * 2)
        handle = self._handle(name)
        return tuple(handle.get_slice(self._stored(name)).get_shape())

    def stored_dtype(self, name: str) -> str | None:
        """The safetensors dtype name ("BF16", "I64", ...) `name` is stored in; None where it is made of other stored
        tensors (quantized, packed) rather than stored as itself."""
        if (self._compressed_module(name) is not None or self._int4_module(name) is not None
                or name not in self.tensor_to_file):
            return None
        return self._handle(name).get_slice(self._stored(name)).get_dtype()

    def read(self, name: str) -> torch.Tensor:
        module = self._compressed_module(name)
        if module is not None:   # dequantized by the library's compressor for the module's scheme
            tensor = module.dequantize(self._read_parameter)
            self.tensors_read += 1
            self.consumed.add(name)
            return tensor
        int4 = self._int4_module(name)
        if int4 is not None:   # AWQ / GPTQ: dequantized by the int4 layout's rule
            return self.read_int4(name).dequantized(int4.layout)
        if self.is_mxfp4(name):
            return self.read_mxfp4_rows(name).dequantized()
        if self.is_fp4(name):
            return self.read_fp4(name).dequantized()
        handle = self._handle(name)
        tensor = handle.get_tensor(self._stored(name))
        self._count(name, tensor)
        if tensor.dtype == torch.float8_e4m3fn:
            return self._dequantized(name, tensor)
        return tensor

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of a tensor, without reading the rest (fused expert tensors)."""
        return self.read_slice(name, 0, start, stop)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """[start, stop) along `dim` (0 or 1) of a tensor, reading only that part (tensor-parallel shards)."""
        if self.is_mxfp4(name):   # experts along dim 0: only theirs are read
            if dim == 0:
                return self.read_mxfp4_rows(name, start, stop).dequantized()
            return self.read(name)[:, start:stop]
        if dim == 0 and self.fbgemm is not None and self.is_fp8(name):   # one scale per row: only these rows
            return self.fbgemm.dequantize(*self._fbgemm_stored(name, start, stop), name)
        if (self._compressed_module(name) is not None or self._int4_module(name) is not None or self.is_fp8(name)
                or self.is_fp4(name)):
            # scales cover groups or blocks: dequantize the whole tensor, then cut
            whole = self.read(name)
            return whole[start:stop] if dim == 0 else whole[:, start:stop]
        view = self._handle(name).get_slice(self._stored(name))
        tensor = view[start:stop] if dim == 0 else view[:, start:stop]
        self._count(name, tensor)
        return tensor

    def read_fp8_rows(self, name: str, block_k: int) -> Fp8Rows:
        """`name` as FP8 values [N, K] with row-expanded scales [N, ceil(K/block_k)].

        A tensor stored in FP8 keeps its values and scales exactly (DeepSeek-style blocks, compressed-tensors'
        float-quantized per tensor / channel / block, fbgemm's row-wise linears); any other is quantized here.
        """
        module = self._compressed_module(name)
        if module is not None and module.stores_fp8():
            values, scale = (self._read_parameter(module.params[local]) for local in ("weight", "weight_scale"))
            self.tensors_read += 1
            self.consumed.add(name)
            return Fp8Rows(values, row_expanded_scales(scale, *values.shape, block_k, name, module.scale_block()))
        if self.fbgemm is not None and self.is_fp8(name):
            values, scales = self.fbgemm.output_major(*self._fbgemm_stored(name), name)
            if values.dim() != 2:
                raise CheckpointError(f"tensor {name!r} is an FP8 expert stack: read it one expert at a time "
                                      f"(read_fp8_expert)")
            return Fp8Rows(values, row_expanded_scales(scales, *values.shape, block_k, name))
        if not self.is_fp8(name):
            return quantize_rows(self.read(name), block_k)
        values = self._handle(name).get_tensor(self._stored(name))
        self._count(name, values)
        scale_inv = self._scales_of(name)
        if self.fp8.block_cols != block_k:
            raise CheckpointError(f"tensor {name!r}: FP8 blocks of {self.fp8.block_cols} columns cannot be kept as "
                                  f"blocks of {block_k}")
        self.fp8.check_scale_shape(values, scale_inv, name)
        return Fp8Rows(values, expand_block_scales(scale_inv, values.shape[0], self.fp8.block_rows))

    def read_fp8_expert(self, name: str, expert: int, block_k: int) -> Fp8Rows:
        """Expert `expert` of an fbgemm FP8 expert stack (Llama 4's input-major `gate_up_proj` / `down_proj`) as
        stored, output-major: values [N, K] with row-expanded scales [N, ceil(K/block_k)]; only its rows are read."""
        if self.fbgemm is None or not self.is_fp8(name):
            raise CheckpointError(f"tensor {name!r} in {self.directory} is no fbgemm FP8 expert stack")
        values, scales = self.fbgemm.output_major(*self._fbgemm_stored(name, expert, expert + 1), name)
        return Fp8Rows(values[0], row_expanded_scales(scales[0], *values.shape[1:], block_k, name))

    def _fbgemm_stored(self, name: str, start: int | None = None, stop: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """An fbgemm FP8 tensor and its `_scale` as stored (rows [start, stop) of dim 0 of both, if given)."""
        scale = self._fbgemm_scale(name, start, stop)   # first: it names what is missing
        return self._stored_rows(name, start, stop), scale

    def _fbgemm_scale(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        scale_name = self.fbgemm.scale_name(name)
        if not self.has(scale_name):
            raise CheckpointError(f"tensor {name!r} in {self.directory} is float8_e4m3fn without its scales "
                                  f"{scale_name!r}")
        return self._stored_rows(scale_name, start, stop)

    def _stored_rows(self, name: str, start: int | None, stop: int | None) -> torch.Tensor:
        view = self._handle(name).get_slice(self._stored(name))
        tensor = view[:] if start is None else view[start:stop]
        self._count(name, tensor)
        return tensor

    def is_fp8(self, name: str) -> bool:
        """Stored as DeepSeek-style FP8 blocks (a compressed-tensors module is read through its compressor)."""
        if self._compressed_module(name) is not None or self._int4_module(name) is not None:
            return False
        return self._handle(name).get_slice(self._stored(name)).get_dtype() == "F8_E4M3"

    def is_fp4(self, name: str) -> bool:
        """Stored as DeepSeek-V4's packed FP4: an int8 weight with block scales in an FP8 checkpoint (transformers
        reads the pair so too, whatever expert_dtype says)."""
        if self.fp8 is None or name not in self.tensor_to_file or not self.has(name + SCALE_SUFFIX):
            return False
        return self._handle(name).get_slice(self._stored(name)).get_dtype() == "I8"

    def read_fp4(self, name: str) -> PackedFp4:
        """An FP4 weight as stored: values uint8 [N, K/2], e8m0 scales uint8 [N, K/32] (MXFP4's layout)."""
        values = self._handle(name).get_tensor(self._stored(name))
        self._count(name, values)
        return PackedFp4.from_stored(values, self._stored_scales(name), name + SCALE_SUFFIX)

    def _dequantized(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.fbgemm is not None:   # row-wise: `<name>_scale`, one scale per output channel
            return self.fbgemm.dequantize(tensor, self._fbgemm_scale(name), name)
        scale_inv = self._scales_of(name)   # first: it names what is missing when the checkpoint is not FP8-ready
        return self.fp8.dequantize(tensor, scale_inv, name)

    def _scales_of(self, name: str) -> torch.Tensor:
        """The block scales `<name>_scale_inv` of an FP8 tensor, refused by name when they cannot be read."""
        scale_name = name + SCALE_SUFFIX
        if self.fp8 is None:
            raise CheckpointError(f"tensor {name!r} in {self.directory} is float8_e4m3fn but config.json has no "
                                  f"quantization_config saying how it is scaled")
        if not self.has(scale_name):
            raise CheckpointError(f"tensor {name!r} in {self.directory} is float8_e4m3fn without its scales "
                                  f"{scale_name!r}")
        return block_scales_as_float(self._stored_scales(name))   # float32, or e8m0 exponents decoded exactly

    def _stored_scales(self, name: str) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        scale = self._handle(scale_name).get_tensor(self._stored(scale_name))
        self._count(scale_name, scale)
        return scale

    def _count(self, name: str, tensor: torch.Tensor) -> None:
        self.bytes_read += tensor.numel() * tensor.element_size()
        self.tensors_read += 1
        self.consumed.add(name)

    def _handle(self, name: str):
        file_name = self.tensor_to_file.get(name)
        if file_name is None:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {self.directory}")
        return self._file(file_name)

    def _file(self, file_name: str):
        """The safetensors file `file_name`, opened on first use."""
        handle = self._handles.get(file_name)
        if handle is None:
            path = self.directory / file_name
            if not path.exists():
                raise CheckpointError(f"weight file {path} is missing")
            handle = _open_safetensors(path)
            self._handles[file_name] = handle
        return handle


def _open_safetensors(path: Path):
    """`path` opened by safetensors; CheckpointError naming it when it is no safetensors file (a truncated or
    half-written shard: safetensors raises its own error type, which a caller refusing bad checkpoints would miss)."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:   # noqa: BLE001 - SafetensorError, and OSError for an unreadable file
        raise CheckpointError(f"weight file {path} is not a readable safetensors file: {exc}") from exc
