"""Which int4 format a checkpoint ships in, which of its modules each int4 weight is, and their layout.

Three formats store weight-only int4 linears, each packed its own way (one file each):
- compressed-tensors `pack-quantized` (compressed_tensors_int4.py: llm-compressor, Kimi K2 Thinking / K2.5),
- AWQ gemm (awq_format.py),
- GPTQ (gptq_format.py, act order included).
All are read into the one int4 layout (moe_runtime/kernels/int4_layout.py) as `Int4Weight`s [N, K]: the reader's
`read_int4` hands the routed experts out so (`--quantization int4`, chosen by itself for an int4 checkpoint, keeps
them so in memory), and dequantizes everything else (attention, dense MLPs, shared experts) through the same rule,
or, for compressed-tensors, through the library's compressor.

The experts of one checkpoint share one layout (`experts_layout`: the in-memory stack has one scale shape): a
checkpoint whose expert weights mix layouts is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.int4_layout import Int4Layout, Int4Weight
from moe_runtime.weights.quantization import awq_format, gptq_format
from moe_runtime.weights.quantization.awq_format import AwqFormat
from moe_runtime.weights.quantization.compressed_tensors_format import CompressedTensorsFormat, quantization_config_dict
from moe_runtime.weights.quantization.compressed_tensors_int4 import CompressedTensorsInt4Format
from moe_runtime.weights.quantization.gptq_format import GptqFormat

EXPERT_MARK = ".experts."          # routed experts' weight names (`mlp.experts.<e>.`, `block_sparse_moe.experts.<e>.`)
PACKED_WEIGHT = "qweight"           # what marks an AWQ / GPTQ module among the stored names


class Int4Format(Protocol):
    """One int4 packing: which stored tensors beside a module make its weight, and how they unpack."""

    name: str                               # for messages
    layout: Int4Layout                      # of every weight stored in it
    parameters: tuple[str, ...]             # required local names (`qweight`, ...), stored as `<module>.<local>`
    optional_parameters: tuple[str, ...]    # read when stored (GPTQ's `g_idx`)

    def unpack(self, stored: dict[str, torch.Tensor], name: str) -> Int4Weight:
        """The module's stored tensors by local name -> its weight [N, K] in the int4 layout."""
        ...

    def shape(self, read: Callable[[str], torch.Tensor], shape_of: Callable[[str], tuple[int, ...]]) -> tuple[int, int]:
        """[N, K] without unpacking: `read` / `shape_of` a stored tensor by local name."""
        ...


@dataclass(frozen=True)
class Int4Module:
    """One int4 linear: the stored tensors behind its `<module>.weight`, and their format."""

    weight_name: str                 # "<module>.weight", what the model reads
    params: dict[str, str]           # local names -> stored names (those stored)
    format: Int4Format

    @property
    def layout(self) -> Int4Layout:
        return self.format.layout

    def read(self, read: Callable[[str], torch.Tensor]) -> Int4Weight:
        return self.format.unpack({local: read(stored) for local, stored in self.params.items()}, self.weight_name)

    def shape(self, read: Callable[[str], torch.Tensor],
              shape_of: Callable[[str], tuple[int, ...]]) -> tuple[int, int]:
        """[N, K] without reading the packed values."""
        return self.format.shape(lambda local: read(self.params[local]), lambda local: shape_of(self.params[local]))


@dataclass(frozen=True)
class Int4Checkpoint:
    """A checkpoint's int4 modules by weight name; `hides_parameters`: its stored parameters are listed by no one
    else (AWQ, GPTQ; compressed-tensors' reader lists its modules already)."""

    method: str                      # config.json's quant_method
    modules: dict[str, Int4Module]
    hides_parameters: bool

    @classmethod
    def of(cls, hf_config, names: list[str], compressed: CompressedTensorsFormat | None,
           where: str) -> "Int4Checkpoint | None":
        """The checkpoint's int4 modules (None: no int4 format; `names`: the stored tensor names)."""
        quant = quantization_config_dict(hf_config) if hf_config is not None else None
        if compressed is not None:
            modules = {}
            for module in compressed.modules.values():
                int4 = CompressedTensorsInt4Format.of(module.scheme)
                if int4 is not None:
                    modules[module.weight_name] = Int4Module(module.weight_name, dict(module.params), int4)
            return cls(quant["quant_method"], modules, hides_parameters=False) if modules else None
        method = (quant or {}).get("quant_method")
        if method == awq_format.QUANT_METHOD:
            packing: Int4Format = AwqFormat.of(quant, where)
        elif method == gptq_format.QUANT_METHOD:
            packing = GptqFormat.of(quant, where)
        else:
            return None
        present = set(names)
        modules = {}
        for name in names:
            if not name.endswith("." + PACKED_WEIGHT):
                continue
            module = name[: -len(PACKED_WEIGHT) - 1]
            params = {local: f"{module}.{local}" for local in (*packing.parameters, *packing.optional_parameters)
                      if local in packing.parameters or f"{module}.{local}" in present}
            missing = [stored for stored in params.values() if stored not in present]
            if missing:
                raise CheckpointError(f"{where}: {module} is {packing.name}-quantized ({name!r}) but {missing[0]!r} "
                                      f"is missing")
            modules[f"{module}.weight"] = Int4Module(f"{module}.weight", params, packing)
        return cls(method, modules, hides_parameters=True)

    def experts_layout(self, where: str) -> Int4Layout | None:
        """The one layout of the routed experts' int4 weights (None: no expert is int4)."""
        first: dict[Int4Layout, str] = {}
        for name, module in self.modules.items():
            if EXPERT_MARK in name:
                first.setdefault(module.layout, name)
        if len(first) > 1:
            (one, a), (other, b) = list(first.items())[:2]
            raise CheckpointError(f"{where}: expert weights mix int4 layouts ({a}: {one}; {b}: {other}); the experts "
                                  f"of one checkpoint must share one to be kept in int4")
        return next(iter(first), None)

    def stored_parameters(self) -> dict[str, list[str]]:
        """Each module's weight name -> its stored tensor names."""
        return {name: list(module.params.values()) for name, module in self.modules.items()}
