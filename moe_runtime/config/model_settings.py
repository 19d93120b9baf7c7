"""The model part of the engine's settings: which checkpoint, on what device and dtype, through which code and
kernels, with which weights in memory, and how its forward runs (eager or one captured graph per decode batch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_runtime.config.config_error import EngineConfigError
from moe_runtime.config.logprobs_mode import LOGPROBS_MODES
from moe_runtime.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

# --dtype names -> torch dtype names (torch is imported where a dtype is needed: `moe-serve --help` stays quick)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
# --quantization choices (None, unset: as the checkpoint ships; "none": every weight in the compute dtype)
QUANTIZATIONS = (None, "none", "fp8", "int8", "mxfp4", "int4")
MODEL_IMPLS = ("auto", "native", "transformers")   # --model-impl
HOST_EXPERT_QUANTIZATIONS = (None, "none", "int8", "fp8")   # what --cpu-experts' host kernels run (kernels/cpu_native)


@dataclass
class ModelSettings:
    model: str
    device: str = "auto"                 # "cpu" | "cuda" | "auto"
    dtype: str = "auto"                  # "auto" = the checkpoint's torch_dtype (fp32 if unset)
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    kernels: str = "auto"                # "auto" | "torch" | "triton" | "cpu" (compiled CPU experts) | "reference"
    # which model code serves the checkpoint: "native" (our own port), "transformers" (transformers' modeling code
    # with our attention and MoE seam: moe_runtime/models/transformers_backend), "auto" (native where there is one)
    model_impl: str = "auto"
    quantization: str | None = None      # "fp8": projections and experts stay FP8 in memory (an FP8 checkpoint's
                                         # blocks as stored; others quantized at load); "int8": int8 with one
                                         # scale per output row, quantized at load; "int4": routed experts as
                                         # packed int4 with group scales (an int4 checkpoint's as stored, others
                                         # quantized at load); "none": every weight in dtype, an int4 or FP8
                                         # checkpoint's dequantized at load; None (unset): as the checkpoint
                                         # ships: in dtype, but an int4 checkpoint's routed experts stay int4
                                         # as stored (config/quantization_choice.py)
    # What a sampled token's logprobs are (vLLM's --logprobs-mode): "raw_logprobs" (the model's), "processed_logprobs"
    # (of the distribution it was drawn from: an RL trainer's old-policy logprob), "raw_logits", "processed_logits"
    logprobs_mode: str = "raw_logprobs"
    # Batch-invariant output (moe_runtime/config/deterministic.py): a request's tokens and logprobs bitwise the same
    # whatever else is batched with it, however its prompt is chunked, on whichever DP worker
    deterministic: bool = False
    enable_torch_compile: bool = False   # pure decode steps run as one torch.compile graph per batch bucket
                                         # (moe_runtime/execution/decode_capture.py; SGLang's --enable-torch-compile)
    torch_compile_max_bs: int = 32       # the largest decode batch bucket captured; larger steps run eagerly
    torch_compile_backend: str = "inductor"  # torch.compile backend; "eager"/"aot_eager" trace only (debugging)
    torch_compile_wrapper: str = "aot"   # CPU: what runs inductor's graph: "python", "cpp" (its C++ wrapper) or
                                         # "aot" (AOTInductor, a library per bucket cached on disk)
    debug_host_reads: bool = False       # count each decode step's host reads (device values read on the host,
                                         # which stall a GPU and break graph capture): WorkerStats.decode_host_reads

    def validate(self) -> None:
        """This part's own values; what needs other parts (a capture with a layout) is `EngineConfig`'s check."""
        if self.quantization not in QUANTIZATIONS:
            raise EngineConfigError(f"--quantization {self.quantization} is not supported; choose one of "
                                    f"{[q for q in QUANTIZATIONS if q]} (or leave it unset: as the checkpoint ships)")
        if self.model_impl not in MODEL_IMPLS:
            raise EngineConfigError(f"--model-impl {self.model_impl!r}: choose one of {', '.join(MODEL_IMPLS)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise EngineConfigError(f"--logprobs-mode {self.logprobs_mode!r}: choose one of "
                                    f"{', '.join(LOGPROBS_MODES)}")
        if self.enable_torch_compile and self.torch_compile_max_bs < 1:
            raise EngineConfigError(f"--torch-compile-max-bs {self.torch_compile_max_bs}: must be >= 1")

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as exc:
            raise InvalidRequestError(f"device={self.device!r} is not a torch device: {exc}") from exc

    def resolved_dtype(self, hf_config) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
            if isinstance(found, torch.dtype):
                return found
            return getattr(torch, DTYPES.get(str(found), "float32"))
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype={self.dtype!r} is not supported; choose one of {sorted(DTYPES)} "
                                      "or 'auto'")
        return getattr(torch, DTYPES[self.dtype])
