"""The engine's `WeightQuantization` for `--quantization` (None: weights in the compute dtype)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

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

logger = logging.getLogger(__name__)


def kept_quantization(config: "EngineConfig", checkpoint_int4: Int4Layout | None) -> str | None:
    """The --quantization the engine keeps its weights in: the one asked for, or, unset, "int4" for a checkpoint whose
    routed experts are stored in int4 (compressed-tensors pack-quantized, AWQ, GPTQ): they stay packed as shipped
    instead of growing four-fold into --dtype. Host-held experts (--cpu-experts) and a captured decode step
    (--enable-torch-compile) run no int4 kernels: there they are dequantized, as before."""
    if config.quantization is not None or checkpoint_int4 is None:
        return config.quantization
    if config.cpu_experts or config.enable_torch_compile:
        logger.info("int4 checkpoint: routed experts dequantized to %s (--cpu-experts and --enable-torch-compile run "
                    "no int4 kernels)", config.dtype)
        return None
    logger.info("int4 checkpoint: routed experts kept packed in int4 as stored (%s); --quantization overrides",
                checkpoint_int4)
    return "int4"


def weights_in_memory(quantization: str | None, checkpoint_fp8: Fp8BlockFormat | None,
                      kernels: KernelSet, checkpoint_int4: Int4Layout | None = None) -> WeightQuantization | None:
    """`checkpoint_fp8`: the checkpoint's own FP8 block format (fp8 keeps its blocks; int8 reads them dequantized).
    mxfp4 keeps an MXFP4 checkpoint's expert bytes as stored and quantizes any other checkpoint's experts.
    `checkpoint_int4`: the layout an int4 checkpoint's routed experts are stored in (`CheckpointReader.
    int4_experts_layout`), which int4 keeps as stored; None: int4 quantizes the experts at load in
    `DEFAULT_INT4_LAYOUT`."""
    if quantization is None:
        return None
    if quantization == "fp8":
        return Fp8InMemory.for_checkpoint(checkpoint_fp8, kernels)
    if quantization == "int8":
        return Int8InMemory(kernels)
    if quantization == "mxfp4":
        return Mxfp4InMemory(kernels)
    if quantization == "int4":
        return Int4InMemory(kernels, checkpoint_int4 or DEFAULT_INT4_LAYOUT)
    raise ValueError(f"no in-memory weight format for quantization {quantization!r}")
