"""The dense model of bench_offline.py's `--dense` rows: Llama-shaped, ~90M parameters (the planner's dense
calibration shape), random weights, the MoE bench checkpoint's tokenizer (llama.cpp's converter needs one; the
benchmarks feed token ids), built once per dtype under bench/.cache."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from moe_runtime.planner.calibration.calibration_models import LLAMA_DENSE_SHAPE

DENSE_SHAPE = LLAMA_DENSE_SHAPE
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
logger = logging.getLogger("bench_offline")


def build_dense_checkpoint(dtype_name: str, cache: Path, tokenizer_from: Path) -> Path:
    path = cache / f"llama-dense-bench-{dtype_name}"
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM, LlamaConfig

    from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights

    logger.info("building the dense %s checkpoint in %s", dtype_name, path)
    config = LlamaConfig(**DENSE_SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed=0, scales=RandomWeightScales(matrix_std=0.03))
    model.to(getattr(torch, dtype_name)).save_pretrained(str(path), safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, path / name)
    return path


def dense_weight_bytes_per_decode_step(dtype_bytes: int) -> float:
    """Every projection and the LM head, whatever the batch (the embedding is read a row per token)."""
    h, layers, inter = (DENSE_SHAPE[n] for n in ("hidden_size", "num_hidden_layers", "intermediate_size"))
    heads, kv, vocab = DENSE_SHAPE["num_attention_heads"], DENSE_SHAPE["num_key_value_heads"], DENSE_SHAPE["vocab_size"]
    head_dim = h // heads
    attention = h * head_dim * (2 * heads + 2 * kv)
    return (layers * (attention + 3 * h * inter) + vocab * h) * dtype_bytes
