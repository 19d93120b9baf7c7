"""The captured decode step compiled ahead of time (AOTInductor): one `.so` per batch bucket, cached on disk.

`torch.compile` runs a graph through dynamo: a Python frame per step, its cache lookup and guards, then inductor's
wrapper (Python, or C++ behind a Python call) with every weight passed in as an argument. AOTInductor instead
compiles the exported step into a shared library whose `run` is C++ from the inputs to the outputs; on the 2-core
CPU that step measured 0.8x the time of the same graph through `torch.compile` with the C++ wrapper (docs/
benchmarks.md, "Offline generation").

How the step is exported (`torch.export`, non-strict):

- **The KV caches are inputs the step mutates** (each layer's keys and values, in place): the cache tensors are
  not module state, and an input mutation is kept by export and applied in place by the compiled library. During
  the trace the layers' `LayerKVCache` objects hold export's tensors; they get their own back afterwards.
- **The weights are not in the library** (`aot_inductor.package_constants_in_so=False`): after loading, the
  library's constants point at the model's own parameters and buffers (`load_constants(user_managed=True)`), so
  no second copy of the weights exists and a weight update in place is seen by the next step.
- **The block table's width is dynamic** (at least `MIN_TABLE_WIDTH` columns), as in the dynamo capture: one
  library per batch bucket.

The cache key is a digest of the exported graph's code, its inputs' and weights' shapes, strides and dtypes, the
intra-op thread count (inductor writes it into the library's parallel loops) and torch's version: the same model
shape, dtype, kernel family, thread count and bucket load the library a previous process compiled (export itself,
seconds, runs in every process: it gives the constants' names and the key).
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moe_runtime.layers.kv_cache import LayerKVCache

logger = logging.getLogger(__name__)

DEFAULT_CACHE = Path.home() / ".cache" / "moe-runtime" / "aot_decode"


class _StepModule(torch.nn.Module):
    """The step as export sees it: the model a submodule (its weights named by their paths), the KV caches inputs."""

    def __init__(self, model: torch.nn.Module, caches: list[LayerKVCache], step: Callable, num_inputs: int):
        super().__init__()
        self.model = model
        self._caches = caches
        self._step = step
        self._num_inputs = num_inputs   # the step's own tensors; the KV caches' follow

    def forward(self, *args):
        inputs, kv = args[:self._num_inputs], args[self._num_inputs:]
        for cache, keys, values in zip(self._caches, kv[0::2], kv[1::2]):
            cache.keys, cache.values = keys, values
        return self._step(*inputs)


@dataclass
class AotBucket:
    """A loaded library: `run` takes the step's tensors (the forward's five, then the sampling parameters) and
    returns (drafter hidden [B, H'], logits [B, V], tokens and statuses [2, B], then the next step's input ids,
    positions, slots and context lengths [B]: `DecodeCapture._next_inputs`)."""
    runner: Callable
    caches: list[LayerKVCache]
    constants: dict[str, torch.Tensor]   # what the library reads as its weights (held: it keeps their addresses)
    addresses: list[int]
    cache_hit: bool

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Sleep level 2 gives a weight new storage on wake (engine/sleep_mode.py): point the library at it again.
        addresses = [tensor.data_ptr() for tensor in self.constants.values()]
        if addresses != self.addresses:
            self.runner.load_constants(self.constants, check_full_update=True, user_managed=True)
            self.addresses = addresses
        return tuple(self.runner(*inputs, *_kv_tensors(self.caches)))


def _kv_tensors(caches: list[LayerKVCache]) -> list[torch.Tensor]:
    if any(cache.values is None for cache in caches):
        raise ValueError("AOT decode step: every layer's cache must hold keys and values")
    return [tensor for cache in caches for tensor in (cache.keys, cache.values)]


def _digest(program: torch.export.ExportedProgram, inputs: tuple[torch.Tensor, ...]) -> str:
    weights = {**program.state_dict, **program.constants}   # the library is specialized to their layouts too
    shapes = [(tuple(t.shape), str(t.dtype)) for t in inputs] + [
        (name, tuple(t.shape), t.stride(), str(t.dtype)) for name, t in sorted(weights.items())]
    # inductor writes the thread count into the library's parallel loops (`omp parallel num_threads(n)`)
    text = (f"{torch.__version__}\n{torch.get_num_threads()} threads\n{program.graph_module.code}\n{shapes}\n"
            f"{program.range_constraints}")
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def compile_bucket(model: torch.nn.Module, caches: list[LayerKVCache], step: Callable,
                   inputs: tuple[torch.Tensor, ...], cache_dir: Path | None = None) -> AotBucket:
    """Export `step` (model forward + LM head + sampling over `inputs`: input_ids, positions, slot_mapping,
    block_tables, context_lens, then the rows' sampling parameters, one bucket's rows), compile it with AOTInductor
    (or load the library compiled before), and point its weights at the model's."""
    kv = _kv_tensors(caches)
    # the width dynamic with the guards the model's code implies (Dim.AUTO: a named range is refused when export
    # cannot prove a guard such as a slice of a position table holds for all of it)
    # (the varargs: one entry, a spec per tensor; only the block table's width is dynamic)
    dynamic = ((None, None, None, {1: torch.export.Dim.AUTO}) + (None,) * (len(inputs) - 4 + len(kv)),)
    try:
        program = torch.export.export(_StepModule(model, caches, step, len(inputs)), (*inputs, *kv),
                                      dynamic_shapes=dynamic,
                                      strict=False)
    finally:
        for cache, keys, values in zip(caches, kv[0::2], kv[1::2]):
            cache.keys, cache.values = keys, values
    cache_dir = DEFAULT_CACHE if cache_dir is None else cache_dir
    path = cache_dir / f"decode-{_digest(program, inputs)}.pt2"
    hit = path.exists()
    if not hit:
        cache_dir.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".staged-{os.getpid()}-{path.name}")   # a .pt2 name, as the packager wants
        with torch._inductor.config.patch({"aot_inductor.package_constants_in_so": False}):
            torch._inductor.aoti_compile_and_package(program, package_path=str(staged))
        staged.replace(path)   # whole or not at all: another process may load it
    loaded = torch._inductor.aoti_load_package(str(path))
    named = {**program.state_dict, **program.constants}
    constants = {name: named[name] for name in loaded.get_constant_fqns()}
    loaded.load_constants(constants, check_full_update=True, user_managed=True)
    logger.info("AOT decode step %s: %s", "loaded" if hit else "compiled", path)
    return AotBucket(loaded, caches, constants, [tensor.data_ptr() for tensor in constants.values()], hit)
