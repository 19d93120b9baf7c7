"""The gated delta rule on CUDA through `fla-core` (flash-linear-attention's Triton ops, the library vLLM and
SGLang call for Gated DeltaNet), an optional dependency (the `gpu` extra). Same contract as the torch twins in
moe_runtime/kernels/delta_rule.py, which remain the path wherever fla is not installed or the tensors are not on CUDA.

Not run on the CPU test machine: its parity with the twins is the GPU check's to establish.
"""
from __future__ import annotations

import importlib.util

import torch


def fla_available(device: torch.device) -> bool:
    """fla's kernels apply: a CUDA device and fla-core installed (found without importing it)."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("fla") is not None


def fla_chunked_delta_rule(q, k, v, g, beta, state):
    """moe_runtime.kernels.delta_rule.chunked_delta_rule through fla's chunk kernel (one sequence as a batch of one).
    q and k come normalised and q scaled, so fla is told scale 1 and no in-kernel L2 norm."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(q[None].float(), k[None].float(), v[None].float(), g[None].float(),
                                        beta[None].float(), scale=1.0, initial_state=state[None].float(),
                                        output_final_state=True)
    return out[0], final[0]


def fla_delta_rule_step(q, k, v, g, beta, state):
    """moe_runtime.kernels.delta_rule.delta_rule_step through fla's fused recurrent kernel (B sequences, one token each)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    out, final = fused_recurrent_gated_delta_rule(q[:, None].float(), k[:, None].float(), v[:, None].float(),
                                                  g[:, None].float(), beta[:, None].float(), scale=1.0,
                                                  initial_state=state.float(), output_final_state=True)
    return out[:, 0], final
