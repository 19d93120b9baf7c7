"""Kimi K2.5 loads as it ships and serves its text model: `KimiK25ForConditionalGeneration` (`model_type: kimi_k25`,
remote code only) with its decoder's config under `text_config` (`model_type: kimi_k2`: DeepSeek-V3), the decoder's
tensors under `language_model.`, and a vision tower (`vision_tower.`) and projector (`mm_projector.`) beside it. A
tiny wrapper in that layout, holding the tiny DeepSeek-V3 checkpoint's weights, gives transformers' tokens for the
text checkpoint; the vision tensors are skipped unread (and said to be). As K2.5 ships them, its projections are
compressed-tensors int4 (W4A16, written by the library: tests/compressed_tensors_checkpoints.py) with the
quantization_config inside text_config; transformers' tokens on the dequantized twin are the oracle."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compressed_tensors_checkpoints import write_compressed_checkpoint
from engine_helpers import greedy
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.planner.model_shape import load_model_shape
from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(21)], [(11 * i + 1) % 380 + 9 for i in range(9)]]
NEW_TOKENS = 8
REMOTE_CODE = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
               "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
               "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}
TEXT_REMOTE_CODE = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                    "AutoModel": "modeling_deepseek.DeepseekV3Model",
                    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
VISION = {   # a few tensors of each part, never read
    "vision_tower.patch_embed.proj.weight": (32, 3, 14, 14),
    "vision_tower.encoder.blocks.0.wqkv.weight": (96, 32),
    "mm_projector.pre_norm.weight": (32,),
    "mm_projector.proj.0.weight": (64, 128),
}


def write_kimi_k25(text_checkpoint, target):
    """The release's layout around a DeepSeek-V3 text checkpoint (transformers' names under `model.` / `lm_head.`;
    its quantization_config, if any, stays inside text_config as K2.5's does)."""
    target.mkdir()
    for file in text_checkpoint.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copyfile(file, target / file.name)
    text = json.loads((text_checkpoint / "config.json").read_text())
    text.update(model_type="kimi_k2", auto_map=TEXT_REMOTE_CODE)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "auto_map": REMOTE_CODE,
              "dtype": text.pop("dtype", "float32"), "media_placeholder_token_id": 3, "pad_token_id": text["pad_token_id"],
              "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "text_config": text,
              "vision_config": {"patch_size": 14, "vt_hidden_size": 32, "vt_num_hidden_layers": 1,
                                "mm_hidden_size": text["hidden_size"]}}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {"language_model." + name: t for name, t in read_all_tensors(text_checkpoint).items()}
    generator = torch.Generator().manual_seed(0)
    tensors.update({name: torch.randn(shape, generator=generator) for name, shape in VISION.items()})
    save_file(tensors, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """(K2.5 release, the dequantized twin of its text model)."""
    root = tmp_path_factory.mktemp("kimi_k25")
    text, twin = write_compressed_checkpoint(tiny_checkpoint_factory("deepseek_v3"), root / "text", root / "twin",
                                             "W4A16")
    return write_kimi_k25(text, root / "release"), twin


@pytest.fixture(scope="module")
def kimi(checkpoints):
    return checkpoints[0]


def test_kimi_k25_serves_its_text_model_with_transformers_tokens(checkpoints, caplog):
    kimi, twin = checkpoints
    config = load_hf_config(kimi)
    assert config.architectures == ["DeepseekV3ForCausalLM"] and config.model_type == "deepseek_v3"
    assert config.quantization_config["quant_method"] == "compressed-tensors"
    stored = set(load_file(str(kimi / "model.safetensors")))
    assert {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight"} <= stored
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in stored
    with caplog.at_level("INFO"), LLM(str(kimi), device="cpu", dtype="float32") as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
    assert tokens == hf_greedy(twin, PROMPTS, NEW_TOKENS)
    shape = load_model_shape(kimi)   # the planner reads it alike (its quantization_config inside text_config)
    assert shape.architecture == "DeepseekV3ForCausalLM" and shape.checkpoint_quantization == "compressed-tensors"
    assert any("KimiK25ForConditionalGeneration's vision tower and projector" in record.getMessage()
               for record in caplog.records)   # skipped, said


def test_a_kimi_k25_text_config_of_an_unknown_type_is_refused_by_name(kimi, tmp_path):
    shutil.copytree(kimi, tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    config["text_config"]["model_type"] = "kimi_k3"
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=r"'kimi_k25' needs a text_config .* got model_type "
                                                           r"'kimi_k3'"):
        load_hf_config(tmp_path / "other")
