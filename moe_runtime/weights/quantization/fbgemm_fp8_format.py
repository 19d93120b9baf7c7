"""fbgemm row-wise FP8 checkpoints (`quant_method: fbgemm_fp8`): Llama 4 Maverick-FP8 as Meta ships it.

transformers' fbgemm integration (integrations/fbgemm_fp8.py) stores, for every module it converts:
- a linear's `weight` float8_e4m3fn [N, K] with `weight_scale` float32 [N, 1]: one scale per output row;
- Llama 4's routed experts (`FbgemmFp8Llama4TextExperts`) as input-major stacks, like the bf16 release's:
  `gate_up_proj` [E, H, 2I] with `gate_up_proj_scale` [E, 1, 2I], and `down_proj` [E, I, H] with
  `down_proj_scale` [E, H, 1]. Both scales hold one value per OUTPUT channel of each expert, the stack's
  last dim (the quantizer transposes each expert to [outputs, inputs], quantizes rows, and reshapes the row
  scales), so down_proj_scale's [H, 1] is not a per-row scale of the [I, H] values it sits beside.

So in both cases `<name>` is stored FP8 beside `<name>_scale` (`SCALE_SUFFIX`), and the weight is its values
times its output channel's scale. `modules_to_not_convert` names the modules left in bf16: they are stored
as plain tensors, which is all the reader needs to know of them. `activation_scale_ub` bounds fbgemm's dynamic
per-row activation quantization; this runtime runs activations in `--dtype`, so it is read by nothing (said
in the log).

The weights are dequantized at load into `--dtype`; `--quantization fp8` keeps them as stored (`output_major`:
one scale per row is a row-expanded block scale repeated over the row's blocks, for any block_k).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moe_runtime.errors import CheckpointError

QUANT_METHOD = "fbgemm_fp8"
SCALE_SUFFIX = "_scale"          # `x.weight` is scaled by `x.weight_scale`, `experts.gate_up_proj` by `..._scale`

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FbgemmFp8Format:
    modules_to_not_convert: tuple[str, ...]
    activation_scale_ub: float | None

    @classmethod
    def of(cls, quantization_config: dict | None, where: str) -> "FbgemmFp8Format | None":
        """The format a config's `quantization_config` (as a dict) declares; None for any other."""
        if not quantization_config or quantization_config.get("quant_method") != QUANT_METHOD:
            return None
        fmt = cls(tuple(quantization_config.get("modules_to_not_convert") or ()),
                  quantization_config.get("activation_scale_ub"))
        logger.info("%s: fbgemm row-wise FP8 weights (%d module(s) left unconverted); activation_scale_ub=%s is "
                    "not used: activations run in --dtype", where, len(fmt.modules_to_not_convert),
                    fmt.activation_scale_ub)
        return fmt

    @staticmethod
    def scale_name(name: str) -> str:
        return name + SCALE_SUFFIX

    @staticmethod
    def channel_scales(values: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
        """float32 scales shaped to multiply `values` by broadcasting: [N, 1] for a linear [N, K], [E, 1, N] for
        an expert stack [E, K, N] (whichever of [E, 1, N] / [E, N, 1] it was stored as)."""
        if values.dim() == 2:
            rows = values.shape[0]
            if scale.numel() != rows or (scale.dim() == 2 and scale.shape[1] != 1):
                raise CheckpointError(f"{name}: fbgemm FP8 weight {tuple(values.shape)} needs {name}{SCALE_SUFFIX} "
                                      f"with one scale per row ({rows}, 1), got {tuple(scale.shape)}")
            return scale.float().reshape(rows, 1)
        if values.dim() == 3:
            experts, _, outputs = values.shape
            if scale.dim() != 3 or scale.shape[0] != experts or sorted(scale.shape[1:]) != [1, outputs]:
                raise CheckpointError(f"{name}: fbgemm FP8 expert stack {tuple(values.shape)} needs "
                                      f"{name}{SCALE_SUFFIX} with one scale per output channel ({experts}, 1, "
                                      f"{outputs}) or ({experts}, {outputs}, 1), got {tuple(scale.shape)}")
            return scale.float().reshape(experts, 1, outputs)
        raise CheckpointError(f"{name}: fbgemm FP8 tensors are linear weights [N, K] or expert stacks [E, K, N], "
                              f"got shape {tuple(values.shape)}")

    def dequantize(self, values: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
        """float32 weight, in the stored layout, from FP8 values and their `_scale`."""
        return values.float() * self.channel_scales(values, scale, name)

    def output_major(self, values: torch.Tensor, scale: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 values [..., N, K], float32 scales [..., N, 1]) as stored: a linear as it is, an expert stack's
        experts transposed to [outputs, inputs] (the values' bytes moved, not rounded)."""
        scales = self.channel_scales(values, scale, name)
        if values.dim() == 2:
            return values, scales
        return values.transpose(1, 2).contiguous(), scales.transpose(1, 2).contiguous()   # [E, N, K], [E, N, 1]
