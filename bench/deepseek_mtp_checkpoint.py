"""The MTP bench checkpoint: DeepSeek-V3's shape scaled down to a small CPU, with a multi-token-prediction layer
appended (moe_runtime/weights/mtp_checkpoint_writer.py), random weights, float32, built once under bench/.cache.

MLA (q_lora 128, kv_lora 64, rope 16 + nope 32 per head, 8 heads), sigmoid grouped top-4 of 32 experts (4
groups, 2 kept) with a shared expert, the first layer dense, 6 layers; the MTP layer is layer 6.
"""
from __future__ import annotations

import logging
from pathlib import Path

from bench.random_checkpoint import save_random_checkpoint
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

CACHE = Path(__file__).resolve().parent / ".cache"
SHAPE = dict(
    vocab_size=4096, hidden_size=384, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
    q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    intermediate_size=1024, moe_intermediate_size=192, n_routed_experts=32, num_experts_per_tok=4,
    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, max_position_embeddings=2048, tie_word_embeddings=False,
)

logger = logging.getLogger("deepseek_mtp_checkpoint")


def build_mtp_checkpoint() -> Path:
    path = CACHE / "deepseekv3-mtp-bench-float32"
    if (path / "config.json").exists():
        return path
    from transformers import DeepseekV3Config

    logger.info("building the checkpoint in %s", path)
    base = save_random_checkpoint(DeepseekV3Config(**SHAPE, initializer_range=0.05), "DeepseekV3ForCausalLM",
                                  CACHE / "deepseekv3-bench-float32")
    return write_mtp_checkpoint(base, path)
