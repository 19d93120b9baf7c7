"""The tiny test checkpoints: every arch loads back in transformers and generates sensibly."""

import json

import pytest
import torch
from safetensors import safe_open
from tiny_checkpoints import TINY_ARCHS, HFOracle, build_tiny_checkpoint, hf_greedy, hf_prefill_logits
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["Hello, my name is", "The capital of France is", "def main():", "x"]
NEW_TOKENS = 24


def read_tensors(path):
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_arch_loads_back_and_greedy_matches_full_forward(arch, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.architectures and config.architectures[0].endswith("ForCausalLM")

    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    oracle = HFOracle(path, cache=False)   # the oracle itself is checked: transformers computes, every run
    outputs = oracle.greedy(prompts, NEW_TOKENS)
    assert [len(o) for o in outputs] == [NEW_TOKENS] * len(PROMPTS)

    # The oracle's incremental (KV-cached) greedy equals argmax over one no-cache forward.
    for prompt, output in zip(prompts, outputs):
        logits = oracle.prefill_logits(prompt + output)  # [T, V]
        assert logits.shape == (len(prompt) + NEW_TOKENS, config.vocab_size)
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == output

    # Not degenerate: most prompts do not collapse to one repeated token, prompts differ.
    assert sum(len(set(o)) > 3 for o in outputs) >= len(PROMPTS) - 1
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)


def test_registry_shapes_fit_parallel_layouts():
    from tiny_checkpoints import tiny_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    gqa = []
    for arch in TINY_ARCHS:
        config = tiny_config(arch, tokenizer)
        experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None) or getattr(
            config, "num_local_experts", None
        )
        if experts:
            assert experts % 4 == 0, arch
        assert config.num_attention_heads % 4 == 0, arch
        if arch != "deepseek_v4":   # its one shared K = V head is whole on every rank by design (MQA)
            assert config.num_key_value_heads % 4 == 0, arch
        gqa.append(config.num_key_value_heads < config.num_attention_heads)
    assert any(gqa)


def test_weights_are_fully_random_and_seeded(tmp_path, tiny_tokenizer_dir):
    a = read_tensors(build_tiny_checkpoint("deepseek_v3", tmp_path / "a", tokenizer=tiny_tokenizer_dir, seed=3))
    b = read_tensors(build_tiny_checkpoint("deepseek_v3", tmp_path / "b", tokenizer=tiny_tokenizer_dir, seed=3))
    c = read_tensors(build_tiny_checkpoint("deepseek_v3", tmp_path / "c", tokenizer=tiny_tokenizer_dir, seed=4))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    for name, tensor in a.items():
        if "norm" in name:
            assert not torch.equal(tensor, torch.ones_like(tensor)), f"{name} left at HF's init (ones)"
        else:
            assert tensor.abs().min() >= 0 and tensor.abs().sum() > 0, f"{name} is all zeros"
    biases = [k for k in a if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2  # layers 1 and 2 are MoE; layer 0 dense (first_k_dense_replace=1)
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in a)


def test_arch_specific_features(tiny_checkpoint_factory):
    qwen2 = read_tensors(tiny_checkpoint_factory("qwen2"))
    assert "lm_head.weight" not in qwen2  # tied embeddings
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0

    qwen2_moe = read_tensors(tiny_checkpoint_factory("qwen2_moe"))
    assert "model.layers.1.mlp.gate_proj.weight" in qwen2_moe  # mlp_only_layers=[1]: dense
    assert "model.layers.0.mlp.shared_expert_gate.weight" in qwen2_moe

    lite = read_tensors(tiny_checkpoint_factory("deepseek_v2_lite"))
    assert "model.layers.0.self_attn.q_proj.weight" in lite
    assert "model.layers.0.self_attn.q_a_proj.weight" not in lite
    full = read_tensors(tiny_checkpoint_factory("deepseek_v2"))
    assert "model.layers.0.self_attn.q_a_proj.weight" in full


def test_overrides_reach_the_config(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("mixtral", num_hidden_layers=3)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    assert tiny_checkpoint_factory("mixtral", num_hidden_layers=3) == path  # built once


def test_sharded_checkpoint_has_index_and_same_weights(tiny_checkpoint_factory):
    sharded = tiny_checkpoint_factory("deepseek_v2", sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) >= 2
    assert all((sharded / f).exists() for f in shard_files)
    assert not (sharded / "model.safetensors").exists()

    single = read_tensors(tiny_checkpoint_factory("deepseek_v2"))
    split = read_tensors(sharded)
    assert single.keys() == split.keys() == set(index["weight_map"])
    assert all(torch.equal(single[k], split[k]) for k in single)
    model = AutoModelForCausalLM.from_pretrained(str(sharded), local_files_only=True)
    assert model.config.n_routed_experts == 8


def test_unknown_arch_is_named(tmp_path, tiny_tokenizer_dir):
    with pytest.raises(ValueError, match="gpt9"):
        build_tiny_checkpoint("gpt9", tmp_path, tokenizer=tiny_tokenizer_dir)


def test_one_shot_oracle_helpers(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    prompt = [0, 44, 337, 352]
    (output,) = hf_greedy(path, [prompt], 3)
    logits = hf_prefill_logits(path, prompt)  # [T, V]
    assert logits.shape == (4, 512) and logits.dtype == torch.float32
    assert output[0] == int(logits[-1].argmax())
    with pytest.raises(ValueError, match=r"prompts_token_ids\[1\]"):
        hf_greedy(path, [[1, 2], []], 2)
