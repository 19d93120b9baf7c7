"""What a model drafter is built from: the engine's pieces, handed over once at start-up."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.execution.model_runner import ModelRunner
from moe_runtime.models.decoder import BuildContext, CausalLM
from moe_runtime.weights.checkpoint import CheckpointReader


@dataclass
class DraftSource:
    config: EngineConfig
    ctx: BuildContext              # how the target's layers were built (kernels, parallel layout, dtype, weight format)
    reader: CheckpointReader       # the checkpoint the target was loaded from
    target: CausalLM
    runner: ModelRunner            # keeps each step's hidden states for the drafter when asked
    num_blocks: int                # the KV cache's blocks: a drafter layer's cache has as many
