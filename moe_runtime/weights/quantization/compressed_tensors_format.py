"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's format), read by the
library's own compressors.

Most 2026 quantized releases ship in this format: `config_groups` name schemes (int4 / int8 weights packed,
`pack-quantized`, with group or channel scales, symmetric or with zero points; FP8 `float-quantized` per
tensor, channel or block; `naive-quantized`) and the modules they target, `ignore` the ones left in full
precision. Each targeted module stores its compression parameters (`weight_packed` + `weight_shape` +
`weight_scale` [+ `weight_zero_point`], or an FP8/int8 `weight` + `weight_scale`) instead of `weight`. The
model asks for `<module>.weight`; `CompressedTensorsFormat` names the stored tensors behind it, and the
library's compressor for the module's scheme (`BaseCompressor.get_value_from_registry(format).decompress`)
turns them back into the dense weight, so every packing order and scale layout is the library's, not ours.

The weights are dequantized at load into `--dtype` (and `--quantization fp8|int8` keeps them quantized in
our own formats from there), but for FP8: `--quantization fp8` keeps a `float-quantized` module's stored values
and scales as they are (`stores_fp8`, `scale_block`; the engine takes its column block from
`fp8_block_structure`). Activation scales (`input_scale`, static W8A8) and KV-cache scales are read by nothing:
activations run in `--dtype` (`SKIPPED_SCALES`, said in the log).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, QuantizationType
from compressed_tensors.utils.match import match_quantizable_tensors

from moe_runtime.errors import CheckpointError

QUANT_METHOD = "compressed-tensors"
SKIPPED_SCALES = r"\.(input_scale|input_zero_point|input_global_scale|output_scale|k_scale|v_scale)$"


@dataclass(frozen=True)
class CompressedModule:
    """One targeted module: the stored tensors its dense `weight` is made from, and how."""

    weight_name: str                 # "<module>.weight", what the model reads
    params: dict[str, str]           # the compressor's local names ("weight_packed", ...) -> stored names
    scheme: object                   # compressed_tensors' QuantizationScheme
    compressor: type                 # its compressor class (classmethod interface)

    def dequantize(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        state = {local: read(stored) for local, stored in self.params.items()}
        return self.compressor.decompress(state, self.scheme)["weight"]

    def stores_fp8(self) -> bool:
        """Whether the module's `weight` is stored as float8_e4m3fn values beside its `weight_scale` (`float-quantized`
        8-bit floats, symmetric: per tensor, channel, group or block), which `--quantization fp8` keeps as stored."""
        weights = self.scheme.weights
        return (weights is not None and weights.type == QuantizationType.FLOAT and weights.num_bits == 8
                and weights.symmetric and set(self.params) == {"weight", "weight_scale"})

    def scale_block(self) -> tuple[int, int] | None:
        """(rows, columns) each `weight_scale` element covers for block and group strategies; None for one scale per
        tensor or per row (channel), which need no block size to place."""
        weights = self.scheme.weights
        if weights.strategy == QuantizationStrategy.BLOCK:
            return tuple(int(b) for b in weights.block_structure)
        if weights.strategy == QuantizationStrategy.GROUP:
            return 1, int(weights.group_size)
        return None

    def shape(self, read: Callable[[str], torch.Tensor], shape_of: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        if "weight_shape" in self.params:   # packed: the original shape is stored beside the values
            return tuple(int(d) for d in read(self.params["weight_shape"]).tolist())
        return shape_of(self.params["weight"])


@dataclass(frozen=True)
class CompressedTensorsFormat:
    modules: dict[str, CompressedModule]   # by weight name

    @classmethod
    def of(cls, hf_config, names: list[str], where: str) -> "CompressedTensorsFormat | None":
        """The checkpoint's modules under its compressed-tensors config (None: another format, or none)."""
        quant = quantization_config_dict(hf_config)
        if quant is None or quant.get("quant_method") != QUANT_METHOD:
            return None
        try:
            config = QuantizationConfig.model_validate(quant)
        except ValueError as exc:
            raise CheckpointError(f"{where}: quantization_config is not a compressed-tensors config the library "
                                  f"reads: {str(exc).splitlines()[0]}") from None
        present = dict.fromkeys(names)
        modules: dict[str, CompressedModule] = {}
        for group, scheme in config.config_groups.items():
            if scheme.format is None:
                scheme.format = CompressionFormat(infer_module_format(torch.nn.Linear, scheme))
            try:
                compressor = BaseCompressor.get_value_from_registry(scheme.format)
                param_names = compressor.compression_param_names(scheme)
            except (KeyError, ValueError, NotImplementedError) as exc:
                raise CheckpointError(f"{where}: compressed-tensors format {scheme.format!r} of config group "
                                      f"{group!r} cannot be read ({exc})") from None
            for module, _ in match_quantizable_tensors(present, ignore=config.ignore, targets=scheme.targets,
                                                        param_targets=[param_names[0]]):
                params = {local: f"{module}.{local}" for local in param_names}
                missing = [stored for stored in params.values() if stored not in present]
                if missing and param_names[0] == "weight":
                    continue   # "Linear" targets every weight by name; one stored without scales is not quantized
                if missing:
                    raise CheckpointError(f"{where}: {module} is quantized by config group {group!r} "
                                          f"({scheme.format}) but {missing[0]!r} is missing")
                modules.setdefault(f"{module}.weight", CompressedModule(f"{module}.weight", params, scheme,
                                                                        compressor))
        return cls(modules)

    def stored_names(self) -> set[str]:
        return {stored for module in self.modules.values() for stored in module.params.values()}


def fp8_block_structure(quant: dict | None) -> tuple[int, int] | None:
    """[bn, bk] of a compressed-tensors config's FP8 `block` schemes (their common divisor when groups differ);
    None when no FP8 weight is cut in blocks (per tensor or channel scales cover whole rows)."""
    if quant is None or quant.get("quant_method") != QUANT_METHOD:
        return None
    blocks = [scheme.get("weights", {}).get("block_structure") for scheme in (quant.get("config_groups") or {}).values()
              if isinstance(scheme, dict) and (scheme.get("weights") or {}).get("type") == QuantizationType.FLOAT.value
              and (scheme.get("weights") or {}).get("strategy") == QuantizationStrategy.BLOCK.value]
    blocks = [block for block in blocks if block]
    if not blocks:
        return None
    return math.gcd(*(int(b[0]) for b in blocks)), math.gcd(*(int(b[1]) for b in blocks))


def quantization_config_dict(hf_config) -> dict | None:
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None or isinstance(quant, dict):
        return quant
    return quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
