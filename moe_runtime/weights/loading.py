"""Fill a model's parameters from a checkpoint, reading only the tensors this rank holds.

Parameters are named like the HF checkpoint's tensors, so most load by name. Modules whose
parameters are assembled from several tensors (stacked experts, dense MLP as one expert)
implement `load_weights(reader, prefix) -> set of parameter names they filled`.

After loading, every tensor of the checkpoint must have been consumed by some rank (the ranks
OR their bitmaps over the checkpoint's sorted tensor names) or be known and deliberately
skipped (`SkippedTensors`, logged). Anything else is an error naming the tensor: a checkpoint
whose tensors the model does not read is a checkpoint it would run wrong.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_runtime.config.multimodal_wrappers import wrapper_of
from moe_runtime.weights.quantization.compressed_tensors_format import (QUANT_METHOD as COMPRESSED_TENSORS,
                                                                        SKIPPED_SCALES, quantization_config_dict)
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.errors import CheckpointError

logger = logging.getLogger(__name__)


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str, directory) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"tensor {name!r} in {directory} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


@dataclass(frozen=True)
class SkippedTensor:
    pattern: str         # a regular expression over tensor names
    why: str             # said once in the log when it matches


@dataclass(frozen=True)
class SkippedTensors:
    """Checkpoint tensors that are known and deliberately not loaded."""

    rules: tuple[SkippedTensor, ...] = ()

    @classmethod
    def for_config(cls, hf_config) -> "SkippedTensors":
        rules = [SkippedTensor(r"(^|\.)rotary_emb\.inv_freq$", "rotary frequencies are computed from the config")]
        num_mtp = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
        if num_mtp:  # DeepSeek-V3's multi-token-prediction layers follow the last decoder layer
            first, last = hf_config.num_hidden_layers, hf_config.num_hidden_layers + num_mtp - 1
            indices = "|".join(str(i) for i in range(first, last + 1))
            rules.append(SkippedTensor(rf"^model\.layers\.({indices})\.",
                                       f"multi-token-prediction layer(s) {first}..{last} (num_nextn_predict_layers="
                                       f"{num_mtp}): read by the MTP drafter when speculative_config's method is \"mtp\", "
                                       "else not used"))
        if getattr(hf_config, "model_type", None) == "deepseek_v4":   # DeepSeek's published MTP layer
            rules.append(SkippedTensor(r"^mtp\.", "DeepSeek-V4's multi-token-prediction layer: read by the MTP "
                                       "drafter when speculative_config's method is \"mtp\", else not used"))
        if (quantization_config_dict(hf_config) or {}).get("quant_method") == COMPRESSED_TENSORS:
            rules.append(SkippedTensor(SKIPPED_SCALES, "compressed-tensors activation / KV-cache scales: activations "
                                       "run in --dtype"))
        wrapper = wrapper_of(hf_config)
        if wrapper is not None:   # a multimodal release served as its text model
            rules.append(SkippedTensor("^(" + "|".join(re.escape(p) for p in wrapper.vision_prefixes) + ")",
                                       f"{wrapper.name}'s vision tower and projector: images are not served"))
        if getattr(hf_config, "layer_types", None) and "linear_attention" in hf_config.layer_types:
            rules.append(SkippedTensor(r"^mtp\.", "Qwen3-Next's multi-token-prediction module: read by the MTP "
                                       "drafter when speculative_config's method is \"mtp\", else not used"))
        return cls(tuple(rules))

    def rule_for(self, name: str) -> SkippedTensor | None:
        return next((rule for rule in self.rules if re.search(rule.pattern, name)), None)


def check_every_tensor_consumed(reader: CheckpointReader, skipped: SkippedTensors, group=None) -> None:
    """CheckpointError naming the tensors no rank read and no rule skips; one log line per skip rule.

    With `group`, the ranks' consumed sets are OR-ed first (expert parallelism spreads the experts,
    pipeline parallelism the layers): every rank then raises the same error, or none does.
    """
    names = sorted(reader.names())
    consumed = torch.tensor([name in reader.consumed for name in names], dtype=torch.uint8)  # [N]
    if group is not None:
        dist.all_reduce(consumed, op=dist.ReduceOp.MAX, group=group)
    unread = [name for name, used in zip(names, consumed.tolist()) if not used]
    unknown, skipped_by_rule = [], {}
    for name in unread:
        rule = skipped.rule_for(name)
        if rule is None:
            unknown.append(name)
        else:
            skipped_by_rule.setdefault(rule.why, []).append(name)
    for why, tensors in skipped_by_rule.items():
        logger.info("skipped %d checkpoint tensor(s) (%s, ...): %s", len(tensors), tensors[0], why)
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise CheckpointError(f"checkpoint {reader.directory} has {len(unknown)} tensor(s) this model does not use: "
                              f"{shown} (an unsupported layer or weight format would load wrong, so it is refused)")


def load_model_weights(model: nn.Module, reader: CheckpointReader, skipped: SkippedTensors = SkippedTensors(),
                       group=None) -> None:
    """Load every parameter of `model`, then check that no checkpoint tensor went unread (see module doc).

    A missing, mismatched or unused tensor is a `CheckpointError`. `group` spans every rank that loads a
    share of this checkpoint (None: this process loads all of it).
    """
    started = time.perf_counter()
    if hasattr(model, "checkpoint_name"):   # a model whose checkpoints name tensors otherwise (DeepSeek-V4)
        reader.renamed(model.checkpoint_name)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    custom_modules = [
        (name, module) for name, module in model.named_modules() if hasattr(module, "load_weights") and module is not model
    ]
    total = len(params)
    next_report = 0.25
    for module_name, module in custom_modules:
        prefix = f"{module_name}." if module_name else ""
        for relative in module.load_weights(reader, prefix):
            loaded.add(prefix + relative)
        if len(loaded) / max(total, 1) >= next_report:
            logger.info("loading weights: %d/%d parameters", len(loaded), total)
            next_report += 0.25
    for name, param in params.items():
        if name in loaded:
            continue
        copy_checked(param, reader.read(name), name, reader.directory)
        loaded.add(name)
    check_every_tensor_consumed(reader, skipped, group)
    logger.info(
        "loaded %d parameters (%d tensors, %.1f MiB read) from %s in %.2fs",
        len(loaded), reader.tensors_read, reader.bytes_read / 2**20, reader.directory, time.perf_counter() - started,
    )
