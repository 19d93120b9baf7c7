"""Multimodal releases load as they ship and serve their text model: Qwen3.5-MoE and Llama 4 as
`...ForConditionalGeneration` (decoder under `text_config`, tensors under `model.language_model.` /
`language_model.model.`, a vision tower and projector beside it). Tiny wrappers written by transformers' own
classes from the tiny text checkpoints' weights give the text checkpoints' greedy tokens (transformers'), the
vision tensors are left unread, and image content is refused naming the part."""
from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from engine_helpers import greedy
from moe_runtime import LLM
from moe_runtime.config.model_config import load_hf_config

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(30)], [(11 * i + 1) % 380 + 9 for i in range(19)]]
NEW_TOKENS = 8
VISION = {   # small vision towers: their tensors are written (and must be skipped), never run
    "qwen3_5_moe": dict(hidden_size=32, depth=1, num_heads=2, intermediate_size=64, patch_size=14,
                        out_hidden_size=None),
    "llama4": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                   image_size=28, patch_size=14, projector_input_dim=32, vision_output_dim=32),
}
WRAPPERS = {"qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
            "llama4": ("Llama4Config", "Llama4ForConditionalGeneration")}


def write_wrapper(arch: str, text_checkpoint, target):
    """The release's layout: transformers' wrapper class holding the text checkpoint's weights, saved."""
    config_class, model_class = (getattr(transformers, name) for name in WRAPPERS[arch])
    text = transformers.AutoModelForCausalLM.from_pretrained(str(text_checkpoint), dtype=torch.float32)
    vision = dict(VISION[arch])
    if "out_hidden_size" in vision:
        vision["out_hidden_size"] = text.config.hidden_size
    else:
        vision["projector_output_dim"] = text.config.hidden_size
    torch.manual_seed(0)
    wrapper = getattr(transformers, model_class.__name__)(config_class(text_config=text.config.to_dict(),
                                                                      vision_config=vision)).eval()
    if arch == "llama4":
        wrapper.language_model.load_state_dict(text.state_dict())
    else:
        wrapper.model.language_model.load_state_dict(text.model.state_dict())
        wrapper.lm_head.load_state_dict(text.lm_head.state_dict())
    wrapper.save_pretrained(str(target))
    for name in text_checkpoint.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            shutil.copy(name, target / name.name)
    return target


@pytest.mark.parametrize("arch", sorted(WRAPPERS))
def test_a_wrapper_serves_its_text_model_with_transformers_tokens(arch, tiny_checkpoint_factory, greedy_oracle,
                                                                 tmp_path, caplog):
    wrapper = write_wrapper(arch, tiny_checkpoint_factory(arch), tmp_path / arch)
    config = load_hf_config(wrapper)
    assert config.architectures == [WRAPPERS[arch][1].replace("ForConditionalGeneration", "ForCausalLM")]
    with caplog.at_level("INFO"), LLM(str(wrapper), device="cpu", dtype="float32") as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
    assert tokens == greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    assert any("images are not served" in record.getMessage() for record in caplog.records)
    assert any("vision tower and projector" in record.getMessage() for record in caplog.records)   # skipped, said


def test_image_content_is_refused_naming_the_part():
    from server_harness import FakeEngine, serve_in_process

    async def scenario(client, _):
        return await client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]})

    answer = serve_in_process(FakeEngine(), scenario)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "messages.0.content", error
    assert "part 1 is an image" in error["message"] and "not served" in error["message"]
