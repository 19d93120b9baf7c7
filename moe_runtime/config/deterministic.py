"""`--deterministic` (`LLM(deterministic=True)`): what batch-invariant output runs on, and what it refuses.

With the option a request's tokens and logprobs are bitwise the same whatever else is in its steps, however its
prompt is chunked or found in the prefix cache, whichever DP worker serves it, with or without two-batch overlap:
the engine runs the batch-invariant kernel family (moe_runtime/kernels/batch_invariant.py, fixed-order
reductions per row). Options whose kernels have no fixed-order version yet are refused here by name, before
anything loads, rather than run and claimed invariant.
"""
from __future__ import annotations

from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
# The largest number of ranks one sum may span: two addends are added the same whichever arrives first (float
# addition commutes), more are summed in an order the collective picks per buffer position.
MAX_RANKS_PER_SUM = 2


def deterministic_refusals(config: EngineConfig) -> list[str]:
    """Each option set in `config` that `--deterministic` cannot run batch-invariantly yet, with why."""
    refusals = []
    device = config.resolved_device()
    if device.type != "cpu":
        refusals.append(f"--device {config.device} ({device.type}): the batch-invariant kernels are the CPU torch "
                        "family's, checked on the CPU only (the Triton / FlashInfer kernels split reductions by "
                        "batch shape)")
    if config.kernels not in ("auto", "torch"):
        refusals.append(f"--kernels {config.kernels}: the batch-invariant family replaces the torch one")
    if config.quantization not in (None, "none"):   # "none": every weight in --dtype, as the float kernels take
        refusals.append(f"--quantization {config.quantization}: the quantized projections and experts have no "
                        "fixed-order kernels yet")
    if config.enable_torch_compile:
        refusals.append("--enable-torch-compile: a captured decode step runs inductor's fused reductions")
    if config.cpu_experts:
        refusals.append("--cpu-experts: the compiled host expert kernels block their reductions by row count")
    if config.speculative_config:
        refusals.append("--speculative-config: verification rows are not checked batch-invariant yet")
    if config.cp > 1:
        refusals.append(f"--cp {config.cp}: context-parallel attention merges the ranks' partial softmaxes in an "
                        "order set by the split")
    if config.dispatch_fp8:
        refusals.append("--dispatch-fp8: the FP8 activation kernels are GPU-only")
    if config.tp > 1:
        refusals.append(f"--tp {config.tp}: the vocab-parallel LM head and dense TP MLPs are not checked "
                        "batch-invariant yet")
    attention_tp = config.ep // config.dp_attn
    if attention_tp > MAX_RANKS_PER_SUM:
        refusals.append(f"--ep {config.ep} --dp-attn {config.dp_attn}: attention TP over {attention_tp} ranks "
                        f"all-reduces more than {MAX_RANKS_PER_SUM} addends, in an order the collective picks per "
                        "buffer position")
    return refusals


def validate_deterministic(config: EngineConfig) -> None:
    refusals = deterministic_refusals(config)
    if refusals:
        raise EngineConfigError("--deterministic cannot be kept with " + "; ".join(refusals))
