"""Whether config.json declares a release's routed experts int4, and in which grouping: what the planner prices
them at (torch-free; the engine reads the same from the stored tensors, weights/quantization/int4_checkpoint.py).

- AWQ (gemm: zero points) and GPTQ (`sym`, `desc_act`: act order's column groups): every linear is int4 but those
  `modules_to_not_convert` names (a substring of the module's name, as transformers matches them);
- compressed-tensors: a `config_groups` scheme of 4-bit int weights (`group` or `channel` strategy) whose `targets`
  take a routed expert's projection and whose `ignore` does not (`re:` patterns matched from the name's start, a
  class name `Linear`, or the module's name or its tail), as the library matches them.

A routed expert's projection is named as the model's checkpoints name it: `model.layers.0.mlp.experts.0.gate_proj`,
or `...block_sparse_moe.experts.0.w1` (Mixtral, MiniMax-M2).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from moe_runtime.errors import CheckpointError
from moe_runtime.weights.quantization.int4_config_fields import int4_bits, int4_group_size

INT4_METHODS = ("awq", "gptq")
COMPRESSED_TENSORS = "compressed-tensors"
INT4_STRATEGIES = ("group", "channel")
BLOCK_SPARSE = ("MixtralForCausalLM", "MiniMaxM2ForCausalLM")   # experts under block_sparse_moe, w1 / w3 / w2
SCALE_BYTES = 4            # the engine keeps int4 scales (and zero points) in float32
COLUMN_GROUP_BYTES = 4     # act order: an int32 group per input column


@dataclass(frozen=True)
class Int4Experts:
    """The routed experts' int4 grouping, as the engine keeps it (kernels/int4_layout.py's `Int4Layout`)."""

    group_size: int | None      # None: one group a row
    zero_points: bool
    column_groups: bool = False

    def bytes_per_weight(self, hidden: int, intermediate: int) -> float:
        """One expert's bytes (w13 [2I, H] and w2 [H, I]: codes, scales, column groups) per weight."""
        def groups(columns: int) -> int:
            return 1 if self.group_size is None else -(-columns // self.group_size)

        codes = 2 * intermediate * -(-hidden // 2) + hidden * -(-intermediate // 2)
        scales = SCALE_BYTES * (1 + self.zero_points) * (2 * intermediate * groups(hidden)
                                                          + hidden * groups(intermediate))
        columns = COLUMN_GROUP_BYTES * (hidden + intermediate) if self.column_groups else 0
        return (codes + scales + columns) / (3 * hidden * intermediate)


def expert_projection_names(architecture: str) -> tuple[str, ...]:
    if architecture in BLOCK_SPARSE:
        return tuple(f"model.layers.0.block_sparse_moe.experts.0.{w}" for w in ("w1", "w2", "w3"))
    return tuple(f"model.layers.0.mlp.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def int4_experts_of(quant: object, architecture: str, where: str = "config.json") -> Int4Experts | None:
    """`quantization_config`'s int4 grouping of the routed experts (None: they are not declared int4)."""
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    names = expert_projection_names(architecture)
    if method in INT4_METHODS:
        label = method.upper()
        int4_bits(quant, label, where)
        group_size = int4_group_size(quant, label, where)
        skipped = quant.get("modules_to_not_convert") or []
        if all(any(str(key) in name for key in skipped) for name in names):
            return None
        if method == "awq":
            return Int4Experts(group_size, zero_points=True)
        return Int4Experts(group_size, zero_points=not quant.get("sym", True),
                           column_groups=bool(quant.get("desc_act", False)))
    if method != COMPRESSED_TENSORS or not isinstance(quant.get("config_groups"), dict):
        return None
    ignore = quant.get("ignore") or []
    for scheme in quant["config_groups"].values():
        weights = scheme.get("weights") if isinstance(scheme, dict) else None
        if (not isinstance(weights, dict) or weights.get("num_bits") != 4 or weights.get("type", "int") != "int"
                or weights.get("strategy") not in INT4_STRATEGIES):
            continue
        if not any(_targets(scheme.get("targets") or [], name) and not _targets(ignore, name) for name in names):
            continue
        group_size = weights.get("group_size") if weights["strategy"] == "group" else None
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or group_size < 1):
            raise CheckpointError(f"{where}: compressed-tensors weights.group_size {group_size!r}: must be a "
                                  f"positive integer")
        return Int4Experts(group_size, zero_points=not weights.get("symmetric", True))
    return None


def _targets(targets: list, name: str) -> bool:
    """Whether one of compressed-tensors' `targets` / `ignore` entries names the linear `name`."""
    for target in targets:
        target = str(target)
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif target == "Linear" or name == target or name.endswith("." + target):
            return True
    return False
