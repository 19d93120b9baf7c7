"""Checkpoint -> transformers model through transformers' own loading rules, tensors read by our reader.

transformers 5 stores some models' weights otherwise than their checkpoints do (Mixtral's per-expert w1/w2/w3
fused into gate_up_proj / down_proj stacks, renamed prefixes, split or merged projections); the rules live in
its conversion mapping (`get_model_conversion_mapping`, WeightRenaming / WeightConverter) and its loader applies
them (`convert_and_load_state_dict_in_model`). This module hands that loader the checkpoint's tensors as lazy
handles read through our `CheckpointReader` (so the engine's check that every tensor was consumed holds, and
names a tensor no rule maps), and finishes as from_pretrained does (`_finalize_model_loading`: non-persistent
buffers such as rotary frequencies computed, tied weights tied).

Before a byte is read the names are matched: every checkpoint tensor must map, under those rules, to a parameter
the model expects (or be skipped deliberately: `SkippedTensors`), and every parameter must be fed by some tensor
(tied ones aside). Otherwise the checkpoint is refused naming the first unmatched names: a checkpoint whose
config names one architecture but whose tensors are another's is never half-loaded.

The experts modules bound to the executor are loaded on the host (all experts, every rank) and their local
experts copied to the device by experts.ExpertsSeam.take_weights; everything else lands on the device directly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.errors import CheckpointError
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import SkippedTensors

logger = logging.getLogger(__name__)
SHOWN = 8   # unmatched names an error lists


class LazyTensor:
    """A checkpoint tensor transformers' loader materializes by indexing (`tensor[...]`), as a safetensors slice."""

    def __init__(self, reader: CheckpointReader, name: str):
        self.reader, self.name = reader, name

    def __getitem__(self, index) -> torch.Tensor:
        return self.reader.read(self.name)[index]


@dataclass(frozen=True)
class NameMatch:
    """Which checkpoint tensors feed which model parameters under transformers' rules."""

    used: list[str]           # checkpoint names the loader gets
    unmatched: list[str]      # checkpoint names no rule maps to a parameter (and no skip rule covers)
    unfed: list[str]          # parameters no checkpoint tensor feeds (tied ones aside)


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(repr(n) for n in names[:SHOWN]) + more


def match_names(model: nn.Module, names: list[str], conversions: list, skipped: SkippedTensors) -> NameMatch:
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    expected = model.state_dict()   # meta tensors at build, loaded ones at a reload: only the names are read
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    used, unmatched, fed = [], [], set()
    for name in sorted(names):
        if skipped.rule_for(name) is not None:
            continue
        renamed, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, expected)
        if renamed not in expected and name in expected:   # as transformers' loader: the name as it stands
            renamed, pattern = rename_source_key(name, [], [], model.base_model_prefix, expected)
        if renamed not in expected:
            unmatched.append(name)
            continue
        used.append(name)
        if pattern is None:
            fed.add(renamed)
        else:   # one converter may fill several parameters (a fused qkv split three ways)
            targets = by_pattern[pattern].target_patterns
            fed.update(renamed.replace(targets[0], target) for target in targets)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    unfed = sorted(set(expected) - fed - tied)
    return NameMatch(used, unmatched, unfed)


def load_transformers_weights(model: nn.Module, reader: CheckpointReader, skipped: SkippedTensors,
                              device: torch.device, dtype: torch.dtype, host_modules: list[str],
                              shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """Load `model` (a transformers PreTrainedModel) from `reader`; `host_modules` (module names) load on the
    host. `shapes`: every parameter's shape and dtype at build, restored (on meta) where an earlier load dropped
    it (the experts the seam took) so that a reload finds the shapes transformers expects."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig, PreTrainedModel

    for name, param in list(model.named_parameters()):
        shape, param_dtype = shapes[name]
        if param.shape != shape:
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr,
                    nn.Parameter(torch.empty(shape, dtype=param_dtype, device="meta"), requires_grad=False))
    conversions = get_model_conversion_mapping(model)
    match = match_names(model, reader.names(), conversions, skipped)
    if match.unmatched:
        raise CheckpointError(
            f"checkpoint {reader.directory}: {len(match.unmatched)} tensor(s) map to no parameter of "
            f"transformers' {type(model).__name__} under its conversion rules: {_shown(match.unmatched)} (the "
            "checkpoint stores another model's tensors than its config names; refused before loading any)")
    if match.unfed:
        raise CheckpointError(
            f"checkpoint {reader.directory}: {len(match.unfed)} parameter(s) of transformers' "
            f"{type(model).__name__} get no tensor under its conversion rules: {_shown(match.unfed)} (refused "
            "before loading any)")
    device_map = {"": str(device), **{f"{module}.": "cpu" for module in host_modules}}
    config = LoadStateDictConfig(device_map=device_map, dtype=dtype, dtype_plan=model._get_dtype_plan(dtype),
                                 weight_mapping=conversions)
    state = {name: LazyTensor(reader, name) for name in match.used}
    # a reload (a weight update): transformers' finishing step empties every non-persistent buffer (rotary
    # frequencies) and recomputes only those of modules not yet initialized, so the computed ones are kept here
    computed = {name: buffer for name, buffer in model.named_non_persistent_buffers() if not buffer.is_meta}
    info, _ = convert_and_load_state_dict_in_model(model, state, config)
    PreTrainedModel._finalize_model_loading(model, config, info)
    for name, buffer in computed.items():
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name)._buffers[attr] = buffer
    problems = [(what, sorted(str(k) for k in keys)) for what, keys in (
        ("missing", info.missing_keys), ("unexpected", info.unexpected_keys), ("mismatched", info.mismatched_keys),
        ("failed to convert", info.conversion_errors)) if keys]
    if problems:
        raise CheckpointError(f"checkpoint {reader.directory}: transformers' loader left parameters "
                              + "; ".join(f"{what}: {_shown(keys)}" for what, keys in problems))
    logger.info("transformers backend: loaded %d checkpoint tensors into %s through %d conversion rule(s)",
                len(match.used), type(model).__name__, sum(1 for c in conversions if c.was_used()))
