"""Releases that name a model type only their remote code defines load as the backbone transformers knows,
without running that code: Kimi K2 (`model_type: kimi_k2`, DeepSeek-V3 weights) gives DeepSeek-V3's tokens; its
tiktoken tokenizer, which only the remote code reads, is named in the warning that token ids alone will work."""
from __future__ import annotations

import json
import logging
import shutil

from engine_helpers import greedy
from moe_runtime import LLM
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.weights.tokenizer_files import load_tokenizer

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(21)], [(11 * i + 1) % 380 + 9 for i in range(9)]]
NEW_TOKENS = 8
KIMI_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}


def as_kimi(source, target):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map=KIMI_AUTO_MAP)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_kimi_k2_loads_as_deepseek_v3_without_remote_code(tiny_checkpoint_factory, greedy_oracle, tmp_path):
    kimi = as_kimi(tiny_checkpoint_factory("deepseek_v3"), tmp_path / "kimi")
    config = load_hf_config(kimi)
    assert config.model_type == "deepseek_v3" and config.architectures == ["DeepseekV3ForCausalLM"]
    with LLM(str(kimi), device="cpu", dtype="float32") as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
    assert tokens == greedy_oracle("deepseek_v3", PROMPTS, NEW_TOKENS)


def test_a_tiktoken_tokenizer_is_named_when_it_cannot_be_read(tmp_path, caplog):
    (tmp_path / "tiktoken.model").write_text("IQ== 0\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": [
        "tokenization_kimi.TikTokenTokenizer", None]}, "tokenizer_class": "TikTokenTokenizer"}))
    with caplog.at_level(logging.WARNING):
        assert load_tokenizer(tmp_path) is None
    assert "tiktoken.model loads only through the release's remote code" in caplog.text
