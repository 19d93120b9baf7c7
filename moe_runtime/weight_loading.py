"""Fill a model's parameters from a checkpoint, reading only the tensors this rank holds.

Parameters are named like the HF checkpoint's tensors, so most load by name. Modules whose
parameters are assembled from several tensors (stacked experts, dense MLP as one expert)
implement `load_weights(reader, prefix) -> set of parameter names they filled`.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from moe_runtime.checkpoint import CheckpointReader
from moe_runtime.errors import CheckpointError

logger = logging.getLogger(__name__)


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str, directory) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"tensor {name!r} in {directory} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def load_model_weights(model: nn.Module, reader: CheckpointReader) -> None:
    """Load every parameter of `model`; a missing or mismatched tensor is a `CheckpointError`."""
    started = time.perf_counter()
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
    logger.info(
        "loaded %d parameters (%d tensors, %.1f MiB read) from %s in %.2fs",
        len(loaded), reader.tensors_read, reader.bytes_read / 2**20, reader.directory, time.perf_counter() - started,
    )
