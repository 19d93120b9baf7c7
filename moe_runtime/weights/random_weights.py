"""Deterministic random weights for a transformers model, independent of HF's own init code.

Every parameter and persistent float buffer is redrawn from one seeded generator in name order,
so a checkpoint depends only on (config, seed). Norm weights land around 1 and biases away from
0 on purpose: a loader that forgets a norm weight or a bias then changes the output, and a test
comparing against transformers catches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RandomWeightScales:
    """Standard deviations of the redrawn weights."""

    matrix_std: float = 0.1  # every >= 2-D tensor (linear, embedding, stacked experts): N(0, std)
    norm_std: float = 0.1  # 1-D tensors named "*norm*": 1 + N(0, std)
    bias_std: float = 0.1  # other 1-D tensors (biases): N(0, std)
    score_bias_std: float = 0.1  # DeepSeek-V3 router e_score_correction_bias: N(0, std)


def randomize_weights(model: torch.nn.Module, seed: int, scales: RandomWeightScales = RandomWeightScales()) -> None:
    """Overwrite `model`'s float parameters and persistent buffers in place, deterministically."""
    generator = torch.Generator().manual_seed(seed)
    state = model.state_dict(keep_vars=True)  # tied weights appear under several names
    seen: set[int] = set()
    with torch.no_grad():
        for name in sorted(state):
            tensor = state[name]
            if id(tensor) in seen or not tensor.is_floating_point():
                continue
            seen.add(id(tensor))
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if "e_score_correction_bias" in name:
                value = noise * scales.score_bias_std
            elif tensor.dim() == 1 and "norm" in name:
                value = 1.0 + noise * scales.norm_std
            elif tensor.dim() == 1:
                value = noise * scales.bias_std
            else:
                value = noise * scales.matrix_std
            tensor.copy_(value.to(tensor.dtype))
