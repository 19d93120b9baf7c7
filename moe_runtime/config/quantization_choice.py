"""Which `--quantization` the engine keeps its weights in, by one rule the engine, the option checks and the planner
all call (torch-free).

- asked for (`fp8`, `int8`, `mxfp4`, `int4`): that one;
- `none`: every weight in `--dtype`, an int4 or FP8 release's dequantized at load;
- unset: as the checkpoint ships. A release whose routed experts are stored int4 (compressed-tensors pack-quantized,
  AWQ, GPTQ) keeps them packed (`automatic`): four times smaller than in --dtype. Host-held experts (--cpu-experts),
  a captured decode step (--enable-torch-compile) and the batch-invariant kernels (--deterministic) run no int4
  kernels: there they are dequantized. An automatic int4 rounds nothing: an expert weight the release stores in
  float is refused by name (int4_in_memory.py), where an asked-for int4 rounds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NO_QUANTIZATION = "none"
INT4 = "int4"


class QuantizationOptions(Protocol):
    """The options the choice reads (EngineConfig has them)."""

    quantization: str | None
    dtype: str
    cpu_experts: bool
    enable_torch_compile: bool
    deterministic: bool


@dataclass(frozen=True)
class AskedQuantization:
    """QuantizationOptions for a caller without an EngineConfig (the planner's command line)."""

    quantization: str | None
    dtype: str = "auto"
    cpu_experts: bool = False
    enable_torch_compile: bool = False
    deterministic: bool = False


@dataclass(frozen=True)
class KeptQuantization:
    quantization: str | None   # the WeightQuantization's name (None: every weight in --dtype)
    automatic: bool            # int4 chosen because the routed experts are stored int4, not asked for
    reason: str                # one line for the log


def kept_quantization(options: QuantizationOptions, experts_stored_int4: bool) -> KeptQuantization:
    """The module docstring's rule. `experts_stored_int4`: the release's routed experts are int4 (the engine: from
    the stored tensors; the planner: from config.json)."""
    asked = options.quantization
    if asked == NO_QUANTIZATION:
        return KeptQuantization(None, False, f"--quantization none: every weight in {options.dtype}")
    if asked is not None:
        return KeptQuantization(asked, False, f"--quantization {asked}")
    if not experts_stored_int4:
        return KeptQuantization(None, False, f"weights in {options.dtype}")
    blocking = [flag for flag, on in (("--cpu-experts", options.cpu_experts),
                                      ("--enable-torch-compile", options.enable_torch_compile),
                                      ("--deterministic", options.deterministic)) if on]
    if blocking:
        return KeptQuantization(None, False, f"int4 checkpoint: routed experts dequantized to {options.dtype} "
                                             f"({', '.join(blocking)} runs no int4 kernels)")
    return KeptQuantization(INT4, True, "int4 checkpoint: routed experts kept packed in int4 as stored "
                                        "(--quantization none serves them in --dtype)")
