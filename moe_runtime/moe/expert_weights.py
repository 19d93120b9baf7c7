"""Experts held stacked: w13[E_local, 2I, H] (gate rows, then up rows), w2[E_local, H, I].

Row i of both tensors is this rank's local slot i; `expert_ids[i]` is the logical expert it holds
(the placement in force says the same). The stack is also the layer's `ExpertStore`: live
rebalancing reads, stages and commits slots through it and never touches the parameters itself.

With `quant` (`--quantization fp8 | int8`, a `WeightQuantization`) w13 and w2 are kept in the
format's values dtype with float32 scales: FP8's row-expanded block scales (`w13_scale`
[E_local, 2I, ceil(H/bk)], `w2_scale` [E_local, H, ceil(I/bk)]) or int8's one scale per row
([E_local, 2I], [E_local, H]). A slot's weights then travel as their bytes, scales included, so
migration and replication move them unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows, WeightQuantization
from moe_runtime.weights.loading import copy_checked


@dataclass(frozen=True)
class ExpertNaming:
    """Checkpoint names of one expert's three projections (relative to `<prefix><expert>.`)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


MIXTRAL_NAMING = ExpertNaming(gate="w1", up="w3", down="w2")


@dataclass(frozen=True)
class StagedSlot:
    """Weights received for a slot, not in force before `commit`."""

    local_slot: int
    expert: int
    packed: torch.Tensor  # [slot_bytes] uint8, as `read_slot` packs them


class ExpertWeights(nn.Module):
    def __init__(self, expert_ids: list[int], hidden_size: int, intermediate_size: int,
                 naming: ExpertNaming = ExpertNaming(), dtype=torch.float32, device=None,
                 quant: WeightQuantization | None = None):
        super().__init__()
        self.expert_ids = list(expert_ids)  # logical expert held by each local slot
        self.naming = naming
        self.intermediate_size = intermediate_size
        self.quant = quant
        num_local = len(self.expert_ids)
        weight_dtype = quant.values_dtype if quant else dtype

        def param(*shape: int, param_dtype=weight_dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=param_dtype, device=device), requires_grad=False)

        self.w13 = param(num_local, 2 * intermediate_size, hidden_size)    # [E_local, 2I, H]
        self.w2 = param(num_local, hidden_size, intermediate_size)         # [E_local, H, I]
        self.w13_scale = self.w2_scale = None
        if quant is not None:   # fp8: [E, 2I, ceil(H/bk)], [E, H, ceil(I/bk)]; int8: [E, 2I], [E, H] (E = E_local)
            self.w13_scale = param(num_local, *quant.scale_shape(2 * intermediate_size, hidden_size),
                                   param_dtype=torch.float32)
            self.w2_scale = param(num_local, *quant.scale_shape(hidden_size, intermediate_size),
                                  param_dtype=torch.float32)
        self._staged: list[StagedSlot] = []

    @property
    def num_local_experts(self) -> int:
        return len(self.expert_ids)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per local slot: the weights, and their scales when kept quantized."""
        return [t for t in (self.w13, self.w13_scale, self.w2, self.w2_scale) if t is not None]

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slot_tensors())

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        """Per-expert tensors (`<prefix><e>.gate_proj.weight`, the HF layout) or fused 3D ones."""
        fused_gate_up = f"{prefix}gate_up_proj"
        inter = self.intermediate_size
        for local, expert in enumerate(self.expert_ids):
            if reader.has(fused_gate_up):
                gate_up = reader.read_rows(fused_gate_up, expert, expert + 1)[0]
                down = reader.read_rows(f"{prefix}down_proj", expert, expert + 1)[0]
                self._fill(local, slice(None), gate_up, fused_gate_up, reader)
                self._fill(local, None, down, f"{prefix}down_proj", reader)
                continue
            base = f"{prefix}{expert}."
            for rows, name in ((slice(0, inter), self.naming.gate), (slice(inter, 2 * inter), self.naming.up)):
                full = f"{base}{name}.weight"
                self._fill(local, rows, self._read(reader, full), full, reader)
            full = f"{base}{self.naming.down}.weight"
            self._fill(local, None, self._read(reader, full), full, reader)
        return {"w13", "w2"} | ({"w13_scale", "w2_scale"} if self.quant else set())

    def _read(self, reader: CheckpointReader, full: str) -> torch.Tensor | QuantizedRows:
        return self.quant.read(reader, full) if self.quant else reader.read(full)

    def _fill(self, local: int, w13_rows: slice | None, tensor: torch.Tensor | QuantizedRows, name: str,
              reader: CheckpointReader) -> None:
        """Copy one checkpoint tensor into slot `local`: rows `w13_rows` of w13, or (None) all of w2."""
        weight, scale = (self.w2, self.w2_scale) if w13_rows is None else (self.w13, self.w13_scale)
        rows = slice(None) if w13_rows is None else w13_rows
        if self.quant is not None and isinstance(tensor, torch.Tensor):
            tensor = self.quant.quantize(tensor)   # a fused stack read in the compute dtype
        if isinstance(tensor, QuantizedRows):
            copy_checked(weight[local, rows], tensor.values, name, reader.directory)
            copy_checked(scale[local, rows], tensor.scales, name + "_scale_inv", reader.directory)
        else:
            copy_checked(weight[local, rows], tensor, name, reader.directory)

    # ---- load_balancer.ExpertStore: a slot travels as the bytes of its tensors, in `slot_tensors` order ----
    def read_slot(self, local_slot: int) -> torch.Tensor:  # -> [slot_bytes] uint8, a copy
        return torch.cat([t[local_slot].reshape(-1).view(torch.uint8) for t in self.slot_tensors()])

    @property
    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.slot_tensors())

    def empty_slot(self) -> torch.Tensor:  # -> [slot_bytes] uint8
        return torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.w13.device)

    def stage(self, local_slot: int, expert: int, packed: torch.Tensor) -> None:
        if not 0 <= local_slot < self.num_local_experts:
            raise IndexError(f"local slot {local_slot} outside this rank's {self.num_local_experts} slots")
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (self.slot_bytes,):
            raise ValueError(f"staged weights for slot {local_slot} are {packed.dtype} of shape {tuple(packed.shape)}, "
                             f"expected uint8 of shape ({self.slot_bytes},)")
        self._staged.append(StagedSlot(local_slot, expert, packed))

    def commit(self) -> None:
        with torch.no_grad():
            for staged in self._staged:
                offset = 0
                for tensor in self.slot_tensors():
                    row = tensor[staged.local_slot].view(torch.uint8).view(-1)   # this slot's bytes, in place
                    row.copy_(staged.packed[offset: offset + row.numel()])
                    offset += row.numel()
                self.expert_ids[staged.local_slot] = staged.expert
        self._staged.clear()

    def discard(self) -> None:
        self._staged.clear()
