"""The two small checkpoints `--gpu cpu` times this machine on: a Qwen3-MoE and a dense Llama, random weights.

The calibration runs the runtime's own decode steps on them (`cpu_step_costs.py`, `cpu_engine_collectives.py`),
so they are built here, with transformers, into the calibration's cache directory: an installed package
calibrates without the repository's bench/ (whose benchmarks use the same shapes, imported from here, so the
calibration bench compares the planner on the models it was calibrated with).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights

logger = logging.getLogger(__name__)

QWEN3_MOE_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_experts=32, num_experts_per_tok=4,
                       moe_intermediate_size=256, intermediate_size=1024, vocab_size=8192, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, norm_topk_prob=True,
                       tie_word_embeddings=False)
LLAMA_DENSE_SHAPE = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12,
                         num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=False)


@dataclass(frozen=True)
class CalibrationModel:
    """A checkpoint the calibration builds once: transformers' config class, its shape, the weights' scale."""

    name: str
    config_class: str            # a transformers config class name
    architecture: str            # config.architectures[0]
    shape: dict = field(default_factory=dict)
    matrix_std: float = 0.05

    def build(self, directory: Path, dtype_name: str = "float32") -> Path:
        """The checkpoint under `directory` (built on first use: a few seconds)."""
        import torch
        import transformers

        path = directory / f"{self.name}-{dtype_name}"
        if (path / "config.json").exists():
            return path
        logger.info("building the %s calibration checkpoint in %s", self.name, path)
        torch.manual_seed(0)
        config = getattr(transformers, self.config_class)(**self.shape, initializer_range=0.05)
        config.architectures = [self.architecture]
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_weights(model, seed=0, scales=RandomWeightScales(matrix_std=self.matrix_std))
        model.to(getattr(torch, dtype_name)).save_pretrained(str(path), safe_serialization=True)
        return path


def moe_calibration_model() -> CalibrationModel:
    return CalibrationModel("qwen3moe-calibration", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE_SHAPE)


def dense_calibration_model() -> CalibrationModel:
    return CalibrationModel("llama-calibration", "LlamaConfig", "LlamaForCausalLM", LLAMA_DENSE_SHAPE, matrix_std=0.03)
