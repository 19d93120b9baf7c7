"""Tiny int4 checkpoints as AWQ (AutoAWQ gemm) and GPTQ (AutoGPTQ / GPTQModel, act order or not) write them, each
beside its exactly dequantized twin.

Every decoder projection (attention, each routed expert; routers stay full precision, as the formats' tools leave
them) is rounded to int4 codes with fp16 group scales and zero points, then packed here by this file's own packer,
a word at a time, following each format's documented layout (not the runtime's unpacker):
- AWQ: `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8], nibble i of word j = output column 8j + AWQ_ORDER[i];
  `scales` fp16 [G, N];
- GPTQ: `qweight` int32 [K/8, N] (nibble i of word [r, n] = input row 8r + i), `qzeros` int32 [G, N/8] (nibble i =
  column 8j + i) holding zero - 1 (checkpoint_format "gptq"), `scales` fp16 [G, N], `g_idx` int32 [K]; with
  `desc_act` the groups follow a random activation order (one per input: gate and up of an expert share theirs).
The twin holds (code - zero) * scale in float32: transformers' tokens on it are the oracle.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from compressed_tensors_checkpoints import is_projection
from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors, write_two_shards

GROUP_SIZE = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ's gemm packing: the column (of its word's eight) nibble i holds
PLAIN_ORDER = tuple(range(8))


@dataclass(frozen=True)
class Int4Codes:
    """One weight [N, K] rounded to int4: codes, per-group fp16 scales and zero points, each column's group."""

    codes: torch.Tensor     # int64 [N, K], 0..15
    scales: torch.Tensor    # float16 [N, G]
    zeros: torch.Tensor     # int64 [N, G], 0..15
    groups: torch.Tensor    # int64 [K]

    def dequantized(self) -> torch.Tensor:   # [N, K] float32
        return (self.codes - self.zeros[:, self.groups]).float() * self.scales.float()[:, self.groups]


def round_to_int4(weight: torch.Tensor, groups: torch.Tensor, symmetric: bool) -> Int4Codes:
    """Min/max rounding per group of columns (`groups` [K]): symmetric with zero point 8, or asymmetric."""
    weight = weight.float()
    index = groups.expand_as(weight)                                               # [N, K]
    start = weight.new_zeros(weight.shape[0], int(groups.max()) + 1)               # [N, G]: 0 joins each min and max
    if symmetric:
        scales = (start.scatter_reduce(1, index, weight.abs(), "amax") / 7).clamp(min=1e-4).half()
        zeros = torch.full(scales.shape, 8, dtype=torch.int64)
    else:
        low, high = start.scatter_reduce(1, index, weight, "amin"), start.scatter_reduce(1, index, weight, "amax")
        scales = ((high - low) / 15).clamp(min=1e-4).half()
        zeros = (-low / scales.float()).round().clamp(1, 15).long()   # v1 GPTQ cannot store a zero point of 0
    codes = (weight / scales.float()[:, groups]).round().long() + zeros[:, groups]
    return Int4Codes(codes.clamp(0, 15), scales, zeros, groups)


def pack_words(codes: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """codes [R, 8W] -> int32 [R, W]: nibble i of word j holds code 8j + order[i]."""
    rows, columns = codes.shape
    words = torch.zeros(rows, columns // 8, dtype=torch.int64)
    for i in range(8):   # every word's nibble i at once: codes 8j + order[i] for j = 0, 1, ...
        words |= codes[:, order[i]::8] << (4 * i)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def awq_tensors(int4: Int4Codes) -> dict[str, torch.Tensor]:
    return {"qweight": pack_words(int4.codes.t(), AWQ_ORDER),                     # [K, N/8]
            "qzeros": pack_words(int4.zeros.t(), AWQ_ORDER),                      # [G, N/8]
            "scales": int4.scales.t().contiguous()}                               # [G, N]


def gptq_tensors(int4: Int4Codes) -> dict[str, torch.Tensor]:
    return {"qweight": pack_words(int4.codes, PLAIN_ORDER).t().contiguous(),      # [K/8, N]: packed along K
            "qzeros": pack_words(int4.zeros.t() - 1, PLAIN_ORDER),                # [G, N/8], zero - 1 (v1)
            "scales": int4.scales.t().contiguous(),                               # [G, N]
            "g_idx": int4.groups.to(torch.int32)}                                 # [K]


def act_order_groups(columns: int, seed: int) -> torch.Tensor:
    """GPTQ's desc_act grouping: columns taken in a (here random) activation order, group_size at a time."""
    order = torch.randperm(columns, generator=torch.Generator().manual_seed(seed))
    groups = torch.empty(columns, dtype=torch.int64)
    groups[order] = torch.arange(columns) // GROUP_SIZE
    return groups


def input_of(module: str) -> str:
    """Modules reading the same input share one activation order (GPTQ's Hessian is the input's): an expert's
    gate and up projections, an attention's q, k and v."""
    for same in ("up_proj", "w3", "k_proj", "v_proj"):
        if module.endswith("." + same):
            return module[: -len(same)] + {"up_proj": "gate_proj", "w3": "w1"}.get(same, "q_proj")
    return module


def write_int4_checkpoint(source: Path, target: Path, twin: Path, method: str, *,
                          desc_act: bool = False) -> tuple[Path, Path]:
    """`method` "awq" (asymmetric, AutoAWQ's only kind) or "gptq" (symmetric without desc_act, asymmetric with it:
    both kinds of zero points)."""
    config = json.loads((source / "config.json").read_text())
    symmetric = method == "gptq" and not desc_act
    packed, dense = {}, {}
    for name, tensor in sorted(read_all_tensors(source).items()):
        if not is_projection(name, tensor):
            packed[name] = dense[name] = tensor
            continue
        module = name[: -len(".weight")]
        columns = tensor.shape[1]
        groups = (act_order_groups(columns, hash_of(input_of(module))) if desc_act
                  else torch.arange(columns) // GROUP_SIZE)
        int4 = round_to_int4(tensor, groups, symmetric)
        stored = awq_tensors(int4) if method == "awq" else gptq_tensors(int4)
        packed.update({f"{module}.{local}": value for local, value in stored.items()})
        dense[name] = int4.dequantized().to(tensor.dtype)
    for path, written in ((target, packed), (twin, dense)):
        copy_side_files(source, path)
        write_two_shards(written, path)
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = quantization_config(method, desc_act, symmetric)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target, twin


def quantization_config(method: str, desc_act: bool, symmetric: bool) -> dict:
    """config.json's quantization_config as each tool writes it."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ["gate"]}
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": desc_act, "sym": symmetric,
            "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False, "true_sequential": True}


def hash_of(text: str) -> int:
    """A seed from a name, the same in every process (Python's str hash is salted)."""
    return sum((i + 1) * ord(c) for i, c in enumerate(text))
