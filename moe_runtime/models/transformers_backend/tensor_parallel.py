"""Tensor parallelism for the transformers backend, from the model's own tp_plan.

transformers' classes say how their modules split over tensor-parallel ranks (`config.base_model_tp_plan`, and
the causal LM class's `_tp_plan` for its head; the model's resolved `_tp_plan` joins both with their prefixes).
transformers applies a plan with DTensors; here each planned module of the meta-built model is given this rank's
shard shape before loading, the checkpoint is read sliced (`shard_of`: only this rank's rows or columns), and
the few modules whose output needs the other ranks' shards do the collective over the attention-TP group:

- "colwise": output features [r * O / tp, (r + 1) * O / tp) (weight rows and bias); q/k/v projections split so
  split whole heads: each rank attends with its heads (transformers' reshapes use -1 for the head count).
- "colwise_gather_output" / "colwise_rep": the same shard, outputs all-gathered along the last dimension (Phi-3's
  fused qkv, the LM head).
- "packed_colwise": the weight is `factor` packed blocks along the output (gate | up): each block split alike.
- "rowwise": input features split; the partial outputs all-reduced, the bias (whole on every rank) added once.
- "rowwise_split_input" / "rowwise_rep": the same, the (replicated) input cut to this rank's columns first.
- "embedding_rowwise": vocabulary rows split; ids outside the shard look up zeros and the ranks' lookups are
  summed (hooks on the module, so a scaled embedding subclass keeps its scaling).
- "replicated_with_grad_allreduce", "sequence_parallel", "replicate", "mla_kv_a_proj": the module stays whole; at
  inference its forward is the same on every rank (the plan only arranges training gradients or a sequence
  split of the same values).

Any other style (unit_colwise, packed_rowwise, moe_tp_experts, local_params, ...) is refused by name, as is a tp
request for a model whose config has no base_model_tp_plan.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError

COLUMN = {"colwise": False, "colwise_gather_output": True, "colwise_rep": True}        # style -> gathers output
ROW = {"rowwise": False, "rowwise_split_input": True, "rowwise_rep": True}             # style -> splits input
PACKED = {"packed_colwise": 2}                                                           # style -> packed blocks
EMBEDDING = frozenset({"embedding_rowwise"})
WHOLE = frozenset({"replicated_with_grad_allreduce", "sequence_parallel", "replicate", "mla_kv_a_proj"})
IMPLEMENTED = frozenset(COLUMN) | frozenset(ROW) | frozenset(PACKED) | EMBEDDING | WHOLE


@dataclass(frozen=True)
class TensorSplit:
    """The attention-TP group the plan splits over."""

    size: int
    rank: int
    group: Any

    def bounds(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` (ceil-sized shards, the last one shorter)."""
        per = -(-total // self.size)
        return min(self.rank * per, total), min((self.rank + 1) * per, total)


@dataclass(frozen=True)
class ParamShard:
    """Which part of a checkpoint tensor this rank keeps: [start, stop) along `dim` of each of `blocks` equal
    blocks (blocks > 1: packed_colwise's gate | up)."""

    dim: int
    start: int
    stop: int
    blocks: int = 1

    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        parts = whole.chunk(self.blocks, dim=self.dim)
        return torch.cat([p.narrow(self.dim, self.start, self.stop - self.start) for p in parts], dim=self.dim)


def _refuse(architecture: str, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"transformers backend ({architecture}): attention tensor parallelism: {what}")


def _gather_last(local: torch.Tensor, total: int, split: TensorSplit) -> torch.Tensor:  # [..., shard] -> [..., total]
    per = -(-total // split.size)
    padded = local if local.shape[-1] == per else F.pad(local, (0, per - local.shape[-1]))
    parts = [torch.empty_like(padded) for _ in range(split.size)]
    dist.all_gather(parts, padded.contiguous(), group=split.group)
    return torch.cat(parts, dim=-1)[..., :total]


class ColumnParallelLinear(nn.Linear):
    """Output features [start, stop) of a whole linear of `full_out` (all-gathered back when `gather`)."""

    def __init__(self, in_features: int, full_out: int, shard: ParamShard, bias: bool, dtype: torch.dtype,
                 split: TensorSplit, gather: bool):
        super().__init__(in_features, (shard.stop - shard.start) * shard.blocks, bias=bias, dtype=dtype,
                         device="meta")
        self.full_out, self.split, self.gather = full_out, split, gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., shard or full_out]
        out = F.linear(x, self.weight, self.bias)
        return _gather_last(out, self.full_out, self.split) if self.gather else out


class RowParallelLinear(nn.Linear):
    """Input features [start, stop) of a whole linear: partial outputs summed over the group, the bias once."""

    def __init__(self, shard: ParamShard, out_features: int, bias: bool, dtype: torch.dtype, split: TensorSplit,
                 split_input: bool):
        super().__init__(shard.stop - shard.start, out_features, bias=bias, dtype=dtype, device="meta")
        self.start, self.stop, self.split, self.split_input = shard.start, shard.stop, split, split_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in (or its shard)] -> [..., out]
        if self.split_input:
            x = x[..., self.start:self.stop]
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.split.group)
        return out if self.bias is None else out + self.bias


@dataclass
class VocabShardHooks:
    """embedding_rowwise on the module itself: ids mapped into this rank's rows [start, stop) before the lookup,
    rows outside zeroed and the ranks' lookups summed after it."""

    start: int
    stop: int
    split: TensorSplit
    mine: torch.Tensor | None = None                                            # [1, T] the ids this rank holds

    def attach(self, module: nn.Embedding) -> None:
        module.register_forward_pre_hook(self.before)
        module.register_forward_hook(self.after)

    def before(self, module, args):
        ids = args[0]
        self.mine = (ids >= self.start) & (ids < self.stop)
        return ((ids - self.start).clamp(0, self.stop - self.start - 1), *args[1:])

    def after(self, module, args, out):
        out = out * self.mine[..., None].to(out.dtype)
        dist.all_reduce(out, group=self.split.group)
        self.mine = None
        return out


@dataclass
class TensorPlan:
    """What the plan did to this rank's model: the shards to read (by parameter name) and the layers whose heads
    it split (their KV heads per rank are the config's divided by the group size)."""

    split: TensorSplit
    shards: dict[str, ParamShard]
    split_head_layers: set[int]


def _plan_regex(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def _layer_of(hf: nn.Module, name: str) -> tuple[int | None, bool]:
    """The layer index of the nearest enclosing module with a `layer_idx`, and whether that is an attention."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        owner = hf.get_submodule(".".join(parts[:cut]))
        index = getattr(owner, "layer_idx", None)
        if isinstance(index, int):
            return index, "Attention" in type(owner).__name__
    return None, False


def _divided(architecture: str, name: str, what: str, total: int, split: TensorSplit) -> ParamShard:
    if total % split.size:
        raise _refuse(architecture, f"{name}'s {total} {what} do not split over {split.size} ranks")
    start, stop = split.bounds(total)
    return ParamShard(0, start, stop)


def apply_tensor_plan(architecture: str, hf: nn.Module, split: TensorSplit, dropped: tuple[str, ...] = ()
                      ) -> TensorPlan:
    """Give the planned modules of the meta-built `hf` this rank's shapes (see the module doc); `dropped`: the
    names of modules another pipeline stage holds (stand-ins here, left alone)."""
    config = hf.config
    if not getattr(config, "base_model_tp_plan", None):
        raise _refuse(architecture, f"{type(config).__name__} has no base_model_tp_plan (transformers does not "
                                    "say how its modules split); use --dp-attn equal to --ep, or no --tp")
    plan = dict(getattr(hf, "_tp_plan", None) or {})
    unknown = sorted({style for style in plan.values() if style not in IMPLEMENTED})
    if unknown:
        entries = [k for k, v in plan.items() if v in unknown]
        raise _refuse(architecture, f"tp_plan style(s) {', '.join(map(repr, unknown))} (on {entries[0]}, ...) are "
                                    f"not implemented; implemented: {', '.join(sorted(IMPLEMENTED))}")
    patterns = [(_plan_regex(key), style) for key, style in plan.items()]
    shards, split_heads = {}, set()
    for name, module in list(hf.named_modules()):
        style = next((s for pattern, s in patterns if pattern.match(name)), None)
        if style is None or style in WHOLE or name in dropped or name.startswith(tuple(f"{d}." for d in dropped)):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = hf.get_submodule(parent_name) if parent_name else hf
        if style in EMBEDDING:
            if not isinstance(module, nn.Embedding):
                raise _refuse(architecture, f"{name} ({type(module).__name__}) is planned {style!r}, for embeddings")
            start, stop = split.bounds(module.num_embeddings)
            shards[f"{name}.weight"] = ParamShard(0, start, stop)
            module.weight = nn.Parameter(torch.empty(stop - start, module.embedding_dim, dtype=module.weight.dtype,
                                                     device="meta"), requires_grad=False)
            VocabShardHooks(start, stop, split).attach(module)
            continue
        if type(module) is not nn.Linear:
            raise _refuse(architecture, f"{name} ({type(module).__name__}) is planned {style!r}; only plain "
                                        "nn.Linear modules are split")
        dtype, bias = module.weight.dtype, module.bias is not None
        if style in ROW:
            shard = _divided(architecture, name, "input features", module.in_features, split)
            shards[f"{name}.weight"] = ParamShard(1, shard.start, shard.stop)
            new = RowParallelLinear(shard, module.out_features, bias, dtype, split, ROW[style])
        else:
            blocks = PACKED.get(style, 1)
            whole = _divided(architecture, name, "output features", module.out_features // blocks, split)
            shard = ParamShard(0, whole.start, whole.stop, blocks)
            shards[f"{name}.weight"] = shard
            if bias:
                shards[f"{name}.bias"] = shard
            new = ColumnParallelLinear(module.in_features, module.out_features, shard, bias, dtype, split,
                                       COLUMN.get(style, False))
            layer, in_attention = _layer_of(hf, name)
            if in_attention and not new.gather:
                split_heads.add(layer)
        setattr(parent, child, new)
    _divide_head_counts(hf, split, split_heads)
    return TensorPlan(split, shards, split_heads)


def _divide_head_counts(hf: nn.Module, split: TensorSplit, layers: set[int]) -> None:
    """Attention modules whose heads are split keep per-rank head counts, for code that reshapes by them."""
    for module in hf.modules():
        if getattr(module, "layer_idx", None) in layers and "Attention" in type(module).__name__:
            for attr in ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads"):
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(module, attr, value // split.size)


def tp_refusal(architecture: str, attn_tp: int) -> str | None:
    """Why `architecture` cannot split its attention over `attn_tp` ranks, from its class's plans alone (the front
    asks before any rank starts; `apply_tensor_plan` finds the same on each rank); None: it can."""
    import transformers

    cls = getattr(transformers, architecture, None)
    config_class = getattr(cls, "config_class", None)
    if attn_tp == 1 or config_class is None:
        return None
    base = getattr(config_class, "base_model_tp_plan", None) or {}
    if not base:
        return (f"attention tensor parallelism over {attn_tp} ranks ({config_class.__name__} has no "
                "base_model_tp_plan); use --dp-attn equal to --ep, or no --tp")
    styles = set(base.values()) | set((getattr(cls, "_tp_plan", None) or {}).values())
    unknown = sorted(styles - IMPLEMENTED)
    if unknown:
        return (f"attention tensor parallelism over {attn_tp} ranks (tp_plan style(s) "
                f"{', '.join(map(repr, unknown))} not implemented)")
    return None
