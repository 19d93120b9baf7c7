"""The engine's `WeightQuantization` for `--quantization` (None: weights in the compute dtype)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from moe_runtime.config.quantization_choice import KeptQuantization, kept_quantization
from moe_runtime.kernels import KernelSet
from moe_runtime.kernels.int4_layout import Int4Layout
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat
from moe_runtime.weights.quantization.fp8_in_memory import Fp8InMemory
from moe_runtime.weights.quantization.int4_in_memory import DEFAULT_INT4_LAYOUT, Int4InMemory
from moe_runtime.weights.quantization.int8_in_memory import Int8InMemory
from moe_runtime.weights.quantization.mxfp4_in_memory import Mxfp4InMemory
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization

if TYPE_CHECKING:
    from moe_runtime.config.engine_config import EngineConfig
    from moe_runtime.weights.checkpoint import CheckpointReader

logger = logging.getLogger(__name__)


def engine_quantization(config: "EngineConfig", checkpoint_int4: Int4Layout | None) -> KeptQuantization:
    """The engine's `kept_quantization` (moe_runtime/config/quantization_choice.py: the rule the option checks and
    the planner call too), logged."""
    choice = kept_quantization(config, checkpoint_int4 is not None)
    if checkpoint_int4 is not None:
        logger.info("%s (%s)", choice.reason, checkpoint_int4)
    return choice


def weights_in_memory(quantization: str | None, checkpoint_fp8: Fp8BlockFormat | None,
                      kernels: KernelSet, checkpoint_int4: Int4Layout | None = None,
                      rounds_float_experts: bool = True) -> WeightQuantization | None:
    """`checkpoint_fp8`: the checkpoint's own FP8 block format (fp8 keeps its blocks; int8 reads them dequantized).
    mxfp4 keeps an MXFP4 checkpoint's expert bytes as stored and quantizes any other checkpoint's experts.
    `checkpoint_int4`: the layout an int4 checkpoint's routed experts are stored in (`CheckpointReader.
    int4_experts_layout`), which int4 keeps as stored; None: int4 quantizes the experts at load in
    `DEFAULT_INT4_LAYOUT`. `rounds_float_experts` False (int4 chosen by itself, `KeptQuantization.automatic`):
    an expert weight stored in float is refused by name instead of rounded to int4."""
    if quantization is None:
        return None
    if quantization == "fp8":
        return Fp8InMemory.for_checkpoint(checkpoint_fp8, kernels)
    if quantization == "int8":
        return Int8InMemory(kernels)
    if quantization == "mxfp4":
        return Mxfp4InMemory(kernels)
    if quantization == "int4":
        return Int4InMemory(kernels, checkpoint_int4 or DEFAULT_INT4_LAYOUT, rounds_float_weights=rounds_float_experts)
    raise ValueError(f"no in-memory weight format for quantization {quantization!r}")


def engine_weights_in_memory(config: "EngineConfig", hf_config, checkpoint_dir: str, reader: "CheckpointReader",
                             kernels: KernelSet) -> WeightQuantization | None:
    """The engine's `WeightQuantization` for its checkpoint: an int4 release's experts stay int4 unless
    `--quantization` says otherwise; FP8 kept in the checkpoint's stored blocks."""
    checkpoint_int4 = reader.int4_experts_layout()
    kept = engine_quantization(config, checkpoint_int4)
    return weights_in_memory(kept.quantization, Fp8BlockFormat.stored_blocks(hf_config, checkpoint_dir), kernels,
                             checkpoint_int4, rounds_float_experts=not kept.automatic)
