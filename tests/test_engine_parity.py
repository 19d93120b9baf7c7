"""Greedy tokens and prefill logits equal transformers' for every supported architecture (fp32)."""
import pytest
import torch

from engine_helpers import PROMPTS, greedy, runtime_prefill_logits
from tiny_checkpoints import hf_greedy, hf_prefill_logits
from moe_runtime import LLM

ARCHS = ["llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
         "deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
NEW_TOKENS = 20


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(arch, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    assert any(len(set(tokens)) > 2 for tokens in expected), "oracle output is degenerate; the test would be weak"
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch)
    prompt = PROMPTS[1]
    expected = hf_prefill_logits(path, prompt)
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        got = runtime_prefill_logits(llm.core, prompt)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_gives_same_tokens(tiny_checkpoint_factory):
    single = tiny_checkpoint_factory("qwen3_moe")
    sharded = tiny_checkpoint_factory("qwen3_moe", sharded=True)
    assert (sharded / "model.safetensors.index.json").exists()
    with LLM(str(single), device="cpu") as a, LLM(str(sharded), device="cpu") as b:
        assert [o.token_ids for o in a.generate(PROMPTS, greedy())] == [o.token_ids for o in b.generate(PROMPTS, greedy())]


def test_text_prompts_and_detokenized_text(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("mixtral")
    with LLM(str(path), device="cpu") as llm:
        [out] = llm.generate(["def fibonacci(n):"], greedy(12))
        assert out.prompt_token_ids == llm.tokenizer.encode("def fibonacci(n):")
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        single = llm.generate("def fibonacci(n):", greedy(12))
        assert single[0].token_ids == out.token_ids
