"""A bench checkpoint: a transformers config's model with random weights (moe_runtime.weights.random_weights),
saved as float32 safetensors, and a tokenizer trained on the standard library's text (vocabulary 4096)."""
from __future__ import annotations

from pathlib import Path

import torch

from moe_runtime.demo.tokenizer_training import TokenizerSpec, save_tokenizer, train_tokenizer
from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights


def save_random_checkpoint(config, architecture: str, path: Path, matrix_std: float = 0.05) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config.architectures = [architecture]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed=0, scales=RandomWeightScales(matrix_std=matrix_std))
    model.save_pretrained(str(path), safe_serialization=True)
    save_tokenizer(train_tokenizer(TokenizerSpec(vocab_size=4096)), path)
    return path
