"""The transformers backend's model split over ranks: a tensor-parallel shard of each layer (tensor_parallel.py)
and/or one pipeline stage of the layers (pipeline_stages.py), behind the same surface as one rank's model.

`split_model` applies the model's plans to the meta-built transformers model before anything is loaded;
`SplitTransformersModel` reads the checkpoint through `ShardedReads` (a planned parameter's tensor read as this
rank's slice only) and skips the tensors of other stages' modules (another stage loads them; the engine's check
that every tensor was consumed ORs the ranks); `SplitTransformersCausalLM` reports this rank's layers and their
per-rank KV heads to the engine and feeds a non-first stage's input activations in at its first layer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.kernels import TopK
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_span import SLIDING
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.models.transformers_backend.model import TransformersCausalLM, TransformersModel
from moe_runtime.models.transformers_backend.pipeline_stages import PipelineStage, keep_stage
from moe_runtime.models.transformers_backend.step_context import LayerAttention
from moe_runtime.models.transformers_backend.support import ATTENTION_LAYER_TYPES
from moe_runtime.models.transformers_backend.tensor_parallel import (ParamShard, TensorPlan, TensorSplit,
                                                                     apply_tensor_plan)
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import SkippedTensors


@dataclass
class ModelSplit:
    """What this rank holds of the model: its tensor-parallel shard (None: whole layers) and its pipeline stage
    (None: every layer)."""

    architecture: str
    tensor: TensorPlan | None
    stage: PipelineStage | None

    @property
    def first_layer(self) -> int:
        return 0 if self.stage is None else self.stage.first

    def owns(self, layer: int) -> bool:
        return self.stage is None or self.stage.owns(layer)

    def local_layers(self, layers: list[LayerAttention]) -> list[LayerAttention]:
        """Each layer's attention as this rank runs it: a head-split layer keeps its KV heads / tp."""
        if self.tensor is None:
            return layers
        size = self.tensor.split.size
        local = []
        for index, layer in enumerate(layers):
            if index in self.tensor.split_head_layers:
                if layer.num_kv_heads % size:
                    raise UnsupportedArchitectureError(
                        f"transformers backend ({self.architecture}): layer {index}'s {layer.num_kv_heads} KV heads "
                        f"do not split over attention TP {size} (transformers' colwise plan splits whole heads)")
                layer = dataclasses.replace(layer, num_kv_heads=layer.num_kv_heads // size)
            local.append(layer)
        return local

    def kv_cache_spec(self, index: int, layer: LayerAttention) -> KVCacheSpec:
        """This rank's heads [start, start + n) of the layer's total (what a P/D transfer re-shards by)."""
        split = self.tensor is not None and index in self.tensor.split_head_layers
        total = layer.num_kv_heads * (self.tensor.split.size if split else 1)
        start = layer.num_kv_heads * self.tensor.split.rank if split else 0
        return KVCacheSpec(layer.num_kv_heads, layer.key_dim, layer.value_dim, start, total, layer.span)


def split_model(architecture: str, hf: nn.Module, parallel: ParallelContext, dtype: torch.dtype) -> ModelSplit | None:
    """Apply the model's pp and tp plans to the meta-built `hf` for this rank (None: one rank holds it whole)."""
    if parallel.pp_size == 1 and parallel.attn_tp_size == 1:
        return None
    layer_types = set(getattr(hf.config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if layer_types:
        raise UnsupportedArchitectureError(
            f"transformers backend ({architecture}): layers of type {', '.join(sorted(map(repr, layer_types)))} "
            f"keep a recurrent state; splitting them over pipeline stages or attention TP is not implemented")
    stage = None
    if parallel.pp_size > 1:
        span = parallel.stage_layers or (0, hf.config.num_hidden_layers)
        stage = keep_stage(architecture, hf, span, parallel.is_first_stage, parallel.is_last_stage, dtype)
    tensor = None
    if parallel.attn_tp_size > 1:
        split = TensorSplit(parallel.attn_tp_size, parallel.attn_tp_rank, parallel.attn_tp_group)
        tensor = apply_tensor_plan(architecture, hf, split, tuple(stage.dropped) if stage is not None else ())
    return ModelSplit(architecture, tensor, stage)


@dataclass(frozen=True)
class CheckpointName:
    """A checkpoint tensor's parameter in the model under transformers' conversion rules."""

    param: str
    converted: bool      # filled by a converter (a merge, split or stack) rather than a rename


def checkpoint_params(hf: nn.Module, names: list[str]) -> dict[str, CheckpointName]:
    """checkpoint name -> the model parameter it fills, by transformers' renaming and conversion rules (as its
    loader renames them)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(hf)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    expected = hf.state_dict()
    out = {}
    for name in names:
        renamed, pattern = rename_source_key(name, renamings, converters, hf.base_model_prefix, expected)
        if renamed not in expected and name in expected:
            renamed, pattern = name, None
        out[name] = CheckpointName(renamed, pattern is not None)
    return out


class ShardedReads:
    """The engine's reader with the planned parameters' tensors read as this rank's slice (`read`); everything
    else is the reader's own (names, directory, the consumed set the engine checks)."""

    def __init__(self, reader: CheckpointReader, slices: dict[str, ParamShard]):
        self.reader, self.slices = reader, slices

    def read(self, name: str) -> torch.Tensor:
        shard = self.slices.get(name)
        if shard is None:
            return self.reader.read(name)
        if shard.blocks == 1:
            return self.reader.read_slice(name, shard.dim, shard.start, shard.stop)
        return shard.cut(self.reader.read(name))

    def __getattr__(self, name: str):
        return getattr(self.reader, name)


class SplitTransformersModel(TransformersModel):
    """`TransformersModel` reading only this rank's share of the checkpoint (see the module doc)."""

    def __init__(self, hf_model: nn.Module, seams, device: torch.device, dtype: torch.dtype, split: ModelSplit):
        super().__init__(hf_model, seams, device, dtype)
        self.split = split

    def load_weights(self, reader, prefix: str) -> set[str]:
        params = checkpoint_params(self.hf, reader.names())
        skipped = self.skipped
        if self.split.stage is not None:
            rule = self.split.stage.skip_rule({name: p.param for name, p in params.items()})
            if rule is not None:
                skipped = SkippedTensors(self.skipped.rules + (rule,))
        slices = {}
        shards = self.split.tensor.shards if self.split.tensor is not None else {}
        for name, p in params.items():
            if p.param in shards:
                if p.converted:
                    raise UnsupportedArchitectureError(
                        f"transformers backend ({self.split.architecture}): attention tensor parallelism: checkpoint "
                        f"tensor {name!r} fills the split parameter {p.param!r} through a conversion rule (a merge "
                        "or split of tensors); slicing converted tensors is not implemented")
                slices[name] = shards[p.param]
        base, self.skipped = self.skipped, skipped
        try:
            return super().load_weights(ShardedReads(reader, slices), prefix)
        finally:
            self.skipped = base


class SplitTransformersCausalLM(TransformersCausalLM):
    """`TransformersCausalLM` on this rank's share: its stage's layers, their per-rank KV heads."""

    def __init__(self, hf_config, backbone: SplitTransformersModel, routed, step, executor):
        super().__init__(hf_config, backbone, routed, step, executor)
        self.split = backbone.split
        self.owned = [i for i in range(len(step.layers)) if self.split.owns(i)]
        self.first_layer = self.split.first_layer
        self.num_layers = len(self.owned)

    def min_sliding_window(self) -> int | None:
        windows = [self.step.layers[i].span.size for i in self.owned if self.step.layers[i].span.kind == SLIDING]
        return min(windows, default=None)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [self.split.kv_cache_spec(i, self.step.layers[i]) for i in self.owned]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                caches: list[LayerKVCache], hidden: torch.Tensor | None = None) -> torch.Tensor:  # [T] -> [T, H]
        """The last stage's final hidden states, or this stage's activations for the next ([T, H]); `caches` are
        this stage's layers', `hidden` the previous stage's activations (None on the first stage)."""
        if input_ids.shape[0] == 0:   # an empty micro-batch: transformers' reshapes cannot infer heads from 0 rows
            return self._empty_step(input_ids)
        stage = self.split.stage
        if stage is None:
            return super().forward(input_ids, positions, batch, caches)
        by_layer = [None] * stage.first + list(caches)                          # by global layer index
        stage.input.hidden = None if stage.is_first else hidden
        try:
            return super().forward(input_ids, positions, batch, by_layer)
        finally:
            stage.input.hidden = None


    def _empty_step(self, input_ids: torch.Tensor) -> torch.Tensor:  # [0] -> [0, H]
        """No tokens on this rank: the MoE layers still meet the expert-parallel group's collectives, in model order,
        as a forward would (attention-TP ranks share their tokens: all of them are empty alike)."""
        hidden = torch.zeros(0, self.hf_config.hidden_size, dtype=self.backbone.dtype, device=input_ids.device)
        for _, seam in self.backbone.seams:
            seam.executor.run(seam.moe_layer, hidden, TopK(weights=torch.zeros(0, 1, device=hidden.device),
                                                           ids=torch.zeros(0, 1, dtype=torch.long,
                                                                           device=hidden.device)))
        return hidden
