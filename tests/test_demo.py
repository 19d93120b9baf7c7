"""The embedded demo model and the locally trained tokenizer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_checkpoints import HFOracle
from transformers import AutoConfig, AutoTokenizer

from moe_runtime.demo.demo_model import DEMO_NAME, REQUIRED_FILES, DemoModelSpec, build_demo_model, ensure_demo_model
from moe_runtime.demo import demo_model as demo
from moe_runtime.demo.tokenizer_training import TokenizerSpec, save_tokenizer, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_tokenizer_builds_are_byte_identical(tmp_path):
    spec = TokenizerSpec(vocab_size=768)
    first = save_tokenizer(train_tokenizer(spec), tmp_path / "a")
    second = save_tokenizer(train_tokenizer(spec), tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_tokenizer_loads_with_auto_tokenizer(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    assert len(tokenizer) == 512
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3

    text = "Hello wörld, 日本語 ✓ 12345\n\tdef f(x): return x"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) < len(text.encode())  # merges were learned
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless
    assert tokenizer("").input_ids == [tokenizer.bos_token_id]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tokenizer(chat, add_special_tokens=False).input_ids
    assert chat_ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # one token each


def test_tokenizer_vocab_too_small_is_named():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(TokenizerSpec(vocab_size=200))


def test_importing_demo_loads_no_heavy_modules():
    code = (
        "import sys, moe_runtime; before = set(sys.modules); import moe_runtime.demo.demo_model; "
        "heavy = {'torch', 'transformers', 'tokenizers'} & (set(sys.modules) - before); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=_env())


@pytest.mark.slow
def test_demo_cli_racing_builders_and_cache(tmp_path):
    """Two processes build the same cache entry at once: one wins, the other reuses it, no debris."""
    target = tmp_path / DEMO_NAME
    by_path = [sys.executable, "-m", "moe_runtime.demo.demo_model", str(target)]
    by_cache = [sys.executable, "-m", "moe_runtime.demo.demo_model"]
    procs = [
        subprocess.Popen(by_path, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        subprocess.Popen(
            by_cache,
            cwd=REPO_ROOT,
            env=_env(MOE_RUNTIME_CACHE=str(tmp_path)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.strip().splitlines()[-1] == str(target)
        assert "demo model" in err  # progress is logged
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]  # no staging dirs left

    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(cache_dir=tmp_path) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime  # built once

    spec = DemoModelSpec()
    config = AutoConfig.from_pretrained(str(target), local_files_only=True)
    assert config.architectures == ["DeepseekV3ForCausalLM"]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (4096, 256, 4)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (16, 4, 4, 2)
    assert (config.q_lora_rank, config.kv_lora_rank, config.first_k_dense_replace) == (128, 64, 1)
    assert config.max_position_embeddings == spec.max_position_embeddings
    with safe_open(str(target / "model.safetensors"), framework="pt") as handle:
        bias = handle.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert handle.get_tensor("lm_head.weight").dtype == torch.float32
    assert bias.shape == (16,) and bias.abs().min() > 0

    tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    assert len(tokenizer) == config.vocab_size
    prompts = [tokenizer(p).input_ids for p in ("Hello, my name is", "def main():", "Once upon a time")]
    outputs = HFOracle(target).greedy(prompts, 16)
    assert all(len(set(o)) > 4 for o in outputs)  # random weights, but not one token repeated


def test_stale_partial_directory_is_refused(tmp_path):
    target = tmp_path / "demo"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match=str(target)):
        build_demo_model(target)


def test_losing_builder_keeps_the_winners_copy(tmp_path):
    def fake_model(directory, marker):
        directory.mkdir()
        for name in REQUIRED_FILES:
            (directory / name).write_text(marker)
        return directory

    winner = fake_model(tmp_path / "model", "winner")
    loser = fake_model(tmp_path / ".model.building-x", "loser")
    demo._move_into_place(loser, winner)
    assert (winner / "config.json").read_text() == "winner"

    empty_placeholder = tmp_path / "placeholder"
    empty_placeholder.mkdir()
    demo._move_into_place(fake_model(tmp_path / ".placeholder.building-y", "new"), empty_placeholder)
    assert (empty_placeholder / "config.json").read_text() == "new"


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env
