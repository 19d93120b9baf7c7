"""compressed-tensors checkpoints (llm-compressor's format, most 2026 quantized releases) load as they ship:
int4 packed with group scales, symmetric and with zero points (W4A16, Kimi K2 Thinking's experts' scheme),
int8 per channel (W8A16), FP8 per tensor (static W8A8), per channel (dynamic) and per block. Each tiny checkpoint
is written by the library's own compressors (tests/compressed_tensors_checkpoints.py), and its greedy tokens
equal transformers' on its dequantized twin: the runtime dequantizes through the same library at load."""
from __future__ import annotations

import pytest

from compressed_tensors_checkpoints import write_compressed_checkpoint
from engine_helpers import greedy
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(21)], [(11 * i + 1) % 380 + 9 for i in range(9)]]
NEW_TOKENS = 8
PRESETS = ["W4A16", "W4A16_ASYM", "W8A16", "FP8", "FP8_DYNAMIC", "FP8_BLOCK"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_compressed_checkpoint_gives_its_dequantized_twins_tokens(preset, tiny_checkpoint_factory, tmp_path):
    compressed, twin = write_compressed_checkpoint(tiny_checkpoint_factory("mixtral"), tmp_path / "compressed",
                                                   tmp_path / "twin", preset)
    stored = set(read_all_tensors(compressed))
    scales = [name for name in stored if name.endswith(".weight_scale")]
    assert len(scales) > 20 and ("W4A16" not in preset or any(n.endswith(".weight_packed") for n in stored))
    with LLM(str(compressed), device="cpu", dtype="float32") as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
    assert tokens == hf_greedy(twin, PROMPTS, NEW_TOKENS)


def test_kept_in_fp8_from_a_compressed_checkpoint(tiny_checkpoint_factory, tmp_path):
    """--quantization fp8 on a W4A16 release: dequantized through the library, then kept FP8 in memory."""
    compressed, twin = write_compressed_checkpoint(tiny_checkpoint_factory("mixtral"), tmp_path / "compressed",
                                                   tmp_path / "twin", "W4A16")
    with LLM(str(compressed), device="cpu", dtype="float32", quantization="fp8") as kept, \
            LLM(str(twin), device="cpu", dtype="float32", quantization="fp8") as from_twin:
        assert ([o.token_ids for o in kept.generate(PROMPTS, greedy(NEW_TOKENS))]
                == [o.token_ids for o in from_twin.generate(PROMPTS, greedy(NEW_TOKENS))])
