"""Experts held stacked: w13[E_local, 2I, H] (gate rows, then up rows), w2[E_local, H, I].

Row i of both tensors is this rank's local slot i; `expert_ids[i]` is the logical expert it holds
(the placement in force says the same). The stack is also the layer's `ExpertStore`: live
rebalancing reads, stages and commits slots through it and never touches the parameters itself.

With `quant` (`--quantization fp8 | int8 | mxfp4 | int4`, a `WeightQuantization`) w13 and w2 are kept in
the format's values dtype and shape with the format's scales: FP8's row-expanded block scales
(`w13_scale` [E_local, 2I, ceil(H/bk)], `w2_scale` [E_local, H, ceil(I/bk)]), int8's one scale per
row ([E_local, 2I], [E_local, H]), or MXFP4's packed codes (w13 [E_local, 2I, ceil(H/32)*16]) with
e8m0 exponents ([E_local, 2I, ceil(H/32)], uint8), or int4's packed codes (w13 [E_local, 2I, ceil(H/2)], uint8)
with float32 group scales ([E_local, 2I, G] or, with zero points, [E_local, 2I, G, 2]). An int4 layout with act
order (`quant.column_groups`) adds each expert's columns' groups, `w13_groups` [E_local, H] and `w2_groups`
[E_local, I] int32 (gate and up rows of one expert share theirs: both quantize the same input). A slot's weights
then travel as their bytes, scales and groups included, so migration and replication move them unchanged,
whatever the format.

gpt-oss's experts add a bias after each projection (`bias=True`: b13 [E_local, 2I] in w13's row
order, b2 [E_local, H], in the compute dtype, part of the slot's bytes) and their own activation
(`activation`, moe_runtime/kernels/expert_activation.py); their checkpoint stacks are transposed and interleave
gate and up columns (`GPT_OSS_NAMING`, read by moe/gpt_oss_expert_stacks.py, MXFP4 or not).
Llama 4's stacks are transposed the same way but not interleaved (`LLAMA4_NAMING`: the first I columns of
`gate_up_proj` are the gate's, as transformers' Llama4TextExperts chunks them).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.moe.gpt_oss_expert_stacks import load_gpt_oss_expert
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat
from moe_runtime.weights.quantization.int4_in_memory import Int4Rows
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows, WeightQuantization
from moe_runtime.weights.loading import copy_checked


@dataclass(frozen=True)
class ExpertNaming:
    """Checkpoint names of one expert's three projections (relative to `<prefix><expert>.`)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    gpt_oss_stacks: bool = False   # gpt-oss: `gate_up_proj` [E, H, 2I] (gate/up interleaved), `down_proj` [E, I, H]
    transposed_stacks: bool = False   # Llama 4: `gate_up_proj` [E, H, 2I] (gate, then up), `down_proj` [E, I, H]


MIXTRAL_NAMING = ExpertNaming(gate="w1", up="w3", down="w2")
GPT_OSS_NAMING = ExpertNaming(gpt_oss_stacks=True)
LLAMA4_NAMING = ExpertNaming(transposed_stacks=True)


@dataclass(frozen=True)
class ExpertSource:
    """The checkpoint a layer's experts came from, and their names' prefix in it."""

    directory: Path
    fp8: Fp8BlockFormat | None
    prefix: str
    hf_config: object = None   # the served model's config the reader was opened with (its renames, quantized formats)
    renames: tuple = ()        # the reader's renames, those `open` applies and then the model's (DeepSeek-V4's names)


@dataclass(frozen=True)
class StagedSlot:
    """Weights received for a slot, not in force before `commit`."""

    local_slot: int
    expert: int
    packed: torch.Tensor  # [slot_bytes] uint8, as `read_slot` packs them


class ExpertWeights(nn.Module):
    def __init__(self, expert_ids: list[int], hidden_size: int, intermediate_size: int,
                 naming: ExpertNaming = ExpertNaming(), dtype=torch.float32, device=None,
                 quant: WeightQuantization | None = None, *, bias: bool = False,
                 activation: ExpertActivation = ExpertActivation()):
        super().__init__()
        self.expert_ids = list(expert_ids)  # logical expert held by each local slot
        self.naming = naming
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.quant = quant
        self.activation = activation
        if quant is not None and not quant.expert_epilogue and (bias or not activation.is_silu):
            raise ValueError(f"--quantization {quant.name} keeps experts whose kernels are bias-free SiLU; these "
                             f"experts have {'biases and ' if bias else ''}activation {activation.kind!r}")
        num_local = len(self.expert_ids)

        def param(*shape: int, param_dtype=dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=param_dtype, device=device), requires_grad=False)

        def weight(rows: int, columns: int) -> nn.Parameter:
            if quant is None:
                return param(num_local, rows, columns)
            return param(num_local, *quant.values_shape(rows, columns), param_dtype=quant.values_dtype)

        self.w13 = weight(2 * intermediate_size, hidden_size)              # [E_local, 2I, H]
        self.w2 = weight(hidden_size, intermediate_size)                   # [E_local, H, I]
        self.w13_scale = self.w2_scale = None
        if quant is not None:   # fp8: [E, 2I, ceil(H/bk)], [E, H, ceil(I/bk)]; int8: [E, 2I], [E, H] (E = E_local)
            self.w13_scale = param(num_local, *quant.scale_shape(2 * intermediate_size, hidden_size),
                                   param_dtype=quant.scales_dtype)
            self.w2_scale = param(num_local, *quant.scale_shape(hidden_size, intermediate_size),
                                  param_dtype=quant.scales_dtype)
        self.w13_groups = self.w2_groups = None
        if quant is not None and quant.column_groups:   # int4 act order: each expert's columns' groups
            self.w13_groups = param(num_local, hidden_size, param_dtype=torch.int32)        # [E_local, H]
            self.w2_groups = param(num_local, intermediate_size, param_dtype=torch.int32)   # [E_local, I]
        self.b13 = param(num_local, 2 * intermediate_size) if bias else None    # [E_local, 2I]
        self.b2 = param(num_local, hidden_size) if bias else None                # [E_local, H]
        self._staged: list[StagedSlot] = []
        self._source: ExpertSource | None = None   # where load_weights read them: a lost expert reloads from there

    def epilogue(self) -> dict:
        """The expert kernels' keyword arguments for these experts' biases and activation ({} for the plain
        bias-free SiLU MLP, so any expert kernel runs it)."""
        if self.b13 is None and self.activation.is_silu:
            return {}
        return {"b13": self.b13, "b2": self.b2, "activation": self.activation}

    def column_group_arguments(self) -> dict:
        """The quantized expert kernels' keyword arguments for act order's column groups ({} without them)."""
        if self.w13_groups is None:
            return {}
        return {"w13_groups": self.w13_groups, "w2_groups": self.w2_groups}

    @property
    def num_local_experts(self) -> int:
        return len(self.expert_ids)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per local slot: the weights, and their scales (and column groups) when kept
        quantized."""
        return [t for t in (self.w13, self.w13_scale, self.w2, self.w2_scale, self.b13, self.b2, self.w13_groups,
                            self.w2_groups) if t is not None]

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slot_tensors())

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        """Per-expert tensors (`<prefix><e>.gate_proj.weight`, the HF layout) or fused 3D ones."""
        if self.b13 is not None and not self.naming.gpt_oss_stacks:
            raise ValueError("expert biases are read from gpt-oss's stacks only (ExpertNaming.gpt_oss_stacks)")
        self._source = ExpertSource(reader.directory, reader.fp8, prefix, reader.hf_config, tuple(reader.renames))
        for local, expert in enumerate(self.expert_ids):
            self._load_slot(reader, prefix, local, expert)
        scales = {"w13_scale", "w2_scale"} if self.quant else set()
        groups = {"w13_groups", "w2_groups"} if self.w13_groups is not None else set()
        return {"w13", "w2"} | scales | groups | ({"b13", "b2"} if self.b13 is not None else set())

    def reload_slot(self, local: int, expert: int) -> None:
        """Load logical `expert` from the checkpoint these experts were loaded from into slot `local` (a slot
        reclaimed after a rank was lost: no surviving rank holds the expert to copy it from)."""
        if self._source is None:
            raise RuntimeError("these experts were not loaded from a checkpoint: nothing to reload a slot from")
        reader = CheckpointReader.open(self._source.directory, self._source.fp8, self._source.hf_config)
        for rename in self._source.renames[len(reader.renames):]:   # the model's, after those `open` applied
            reader.renamed(rename)
        with torch.no_grad():
            self._load_slot(reader, self._source.prefix, local, expert)
        self.expert_ids[local] = expert

    def _load_slot(self, reader: CheckpointReader, prefix: str, local: int, expert: int) -> None:
        if self.naming.gpt_oss_stacks:
            load_gpt_oss_expert(self, reader, prefix, local, expert)
            return
        fused_gate_up = f"{prefix}gate_up_proj"
        inter = self.intermediate_size
        if reader.has(fused_gate_up):
            gate_up, down = (self._read_stacked(reader, name, expert) for name in (fused_gate_up, f"{prefix}down_proj"))
            self._fill(local, slice(None), gate_up, fused_gate_up, reader)
            self._fill(local, None, down, f"{prefix}down_proj", reader)
            return
        base = f"{prefix}{expert}."
        for rows, name in ((slice(0, inter), self.naming.gate), (slice(inter, 2 * inter), self.naming.up)):
            full = f"{base}{name}.weight"
            self._fill(local, rows, self._read(reader, full), full, reader)
        full = f"{base}{self.naming.down}.weight"
        self._fill(local, None, self._read(reader, full), full, reader)

    def _read_stacked(self, reader: CheckpointReader, name: str, expert: int) -> torch.Tensor | QuantizedRows:
        """Expert `expert` of a fused stack as [rows, columns]: kept as stored where an FP8 stack (fbgemm's, Llama 4
        Maverick's) meets --quantization fp8, else read in a float dtype (Llama 4's input-major stacks transposed)."""
        if (self.quant is not None and self.quant.name == "fp8" and self.naming.transposed_stacks
                and reader.fbgemm is not None and reader.is_fp8(name)):
            return self.quant.checked(reader.read_fp8_expert(name, expert, self.quant.block_k), name)
        stack = reader.read_rows(name, expert, expert + 1)[0]
        if self.naming.transposed_stacks:   # stored input-major (x @ w): [H, 2I], [I, H]
            return stack.transpose(0, 1).contiguous()
        return stack

    def _read(self, reader: CheckpointReader, full: str) -> torch.Tensor | QuantizedRows:
        return self.quant.read(reader, full) if self.quant else reader.read(full)

    def fill(self, local: int, w13_rows: slice | None, tensor: torch.Tensor | QuantizedRows, name: str,
             reader: CheckpointReader) -> None:
        """Copy one expert's w13 rows (or, None, its whole w2) read in the compute dtype or already in this
        stack's format (`QuantizedRows`) into slot `local` (moe/gpt_oss_expert_stacks.py's entry point)."""
        self._fill(local, w13_rows, tensor, name, reader)

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
            if self.w13_groups is not None:
                self._fill_groups(local, w13_rows, tensor, name, reader)
        else:
            copy_checked(weight[local, rows], tensor, name, reader.directory)

    def _fill_groups(self, local: int, w13_rows: slice | None, tensor: QuantizedRows, name: str,
                     reader: CheckpointReader) -> None:
        """Act order: the tensor's columns' groups into the slot's; w13's first rows (the gate) set them, its later
        rows (the up projection) must name the same groups."""
        found = tensor.column_groups if isinstance(tensor, Int4Rows) else None
        if found is None:
            raise CheckpointError(f"tensor {name!r} in {reader.directory} carries no column groups; the experts' "
                                  f"int4 layout has act order ({self.quant.name})")
        groups = self.w2_groups if w13_rows is None else self.w13_groups
        if w13_rows is not None and (w13_rows.start or 0) > 0:
            if not torch.equal(groups[local].cpu(), found.to(groups.dtype).cpu()):
                raise CheckpointError(f"tensor {name!r} in {reader.directory}: its column groups (g_idx) differ from "
                                      f"its expert's gate projection's; the experts' kernels quantize both from one "
                                      f"input and keep one column order per expert")
            return
        copy_checked(groups[local], found, name + "_groups", reader.directory)

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
