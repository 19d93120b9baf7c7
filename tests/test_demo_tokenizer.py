"""The demo's (and the tiny checkpoints') tokenizer loads with every transformers version the project accepts.

transformers 5 saves a fast tokenizer as `TokenizersBackend` with a list of `extra_special_tokens`;
transformers 4.57 (inside the `>=4.57` pin) can load neither. The contract test checks the saved
config says what both read; the slow test loads the same files with the oldest accepted minor
version in a child virtual environment and compares what it makes of them with this one.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import transformers
from transformers import AutoTokenizer

from moe_runtime.demo.demo_model import default_cache_root, demo_tokenizer_spec
from moe_runtime.demo.tokenizer_training import (CHAT_TEMPLATE, IM_END_TOKEN, IM_START_TOKEN, PORTABLE_TOKENIZER_CLASS,
                                            TOKENIZER_CONFIG_FILE, portable_tokenizer_config, save_tokenizer,
                                            train_tokenizer)

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_TEXT = "Hello wörld, 日本語 ✓ 12345\n\tdef f(x): return x"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

# What a loader makes of a saved tokenizer: run here and, as a script, under the oldest transformers.
DESCRIBE = """
import json, sys
from transformers import AutoTokenizer

def describe(path, sample, tools, conversation):
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return {
        "length": len(tokenizer),
        "special": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token],
        "special_ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "all_special": sorted(tokenizer.all_special_tokens),
        "ids": tokenizer(sample).input_ids,
        "decoded": tokenizer.decode(tokenizer(sample).input_ids, skip_special_tokens=True),
        "chat": tokenizer.apply_chat_template(conversation[:2], add_generation_prompt=True, tokenize=False),
        "chat_with_tools": tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True,
                                                         tokenize=False),
    }

if __name__ == "__main__":
    paths, sample, tools, conversation = json.loads(sys.stdin.read())
    print(json.dumps([describe(path, sample, tools, conversation) for path in paths]))
"""


def describe_here(path: Path) -> dict:
    namespace: dict = {}
    exec(compile(DESCRIBE, "describe", "exec"), namespace)   # the very code the child venv runs
    return namespace["describe"](str(path), SAMPLE_TEXT, TOOLS, CONVERSATION)


@pytest.fixture(scope="module")
def demo_tokenizer_dir(tmp_path_factory):
    """The demo checkpoint's tokenizer files, written by the code that writes them into the demo model."""
    return save_tokenizer(train_tokenizer(demo_tokenizer_spec()), tmp_path_factory.mktemp("demo_tokenizer"))


@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_saved_config_names_what_every_supported_transformers_loads(which, demo_tokenizer_dir, tiny_tokenizer_dir):
    directory = demo_tokenizer_dir if which == "demo" else tiny_tokenizer_dir
    config = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" == PORTABLE_TOKENIZER_CLASS
    assert not isinstance(config.get("extra_special_tokens"), list)   # 4.x reads it as a dict of named tokens
    assert config["additional_special_tokens"] == [IM_START_TOKEN, IM_END_TOKEN]
    assert (directory / "chat_template.jinja").read_text() == CHAT_TEMPLATE

    loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert isinstance(loaded, transformers.PreTrainedTokenizerFast)
    assert {IM_START_TOKEN, IM_END_TOKEN} <= set(loaded.all_special_tokens)
    im_end = loaded.convert_tokens_to_ids(IM_END_TOKEN)
    assert loaded.decode([im_end], skip_special_tokens=True) == ""   # still special: skipped in output text


def test_portable_config_rewrites_only_what_4x_cannot_read():
    saved_by_5x = {"tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<a>", "<b>"],
                   "bos_token": "<s>", "model_max_length": 8}
    assert portable_tokenizer_config(saved_by_5x) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "additional_special_tokens": ["<a>", "<b>"],
        "bos_token": "<s>", "model_max_length": 8}
    named = {"tokenizer_class": "PreTrainedTokenizerFast", "extra_special_tokens": {"image_token": "<img>"}}
    assert portable_tokenizer_config(named) == named   # the dict form both versions read is left alone


def oldest_supported_transformers() -> str:
    """The lower bound of the `transformers>=X.Y` pin in pyproject.toml."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    match = re.search(r'"transformers>=([0-9]+\.[0-9]+)', pyproject)
    assert match, "pyproject.toml pins no transformers lower bound"
    return match.group(1)


def child_venv_with(requirement: str, name: str) -> Path:
    """A virtual environment with only `requirement` (and jinja2) installed, built once and kept in the cache.

    Built in a temporary sibling and renamed into place, so an interrupted build is never reused.
    """
    root = default_cache_root() / "test-venvs"
    target = root / name
    python = target / "bin" / "python"
    if python.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=root))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True, capture_output=True, timeout=120)
        install = subprocess.run([str(staging / "bin" / "python"), "-m", "pip", "install", "-q", requirement, "jinja2"],
                                 capture_output=True, text=True, timeout=300)
        assert install.returncode == 0, f"pip could not install {requirement}:\n{install.stderr[-3000:]}"
        staging.rename(target)   # venv scripts hold their path; only `bin/python -c` / `-m` are used from it
    except OSError:
        if not python.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@pytest.mark.slow
def test_oldest_supported_transformers_loads_the_demo_and_tiny_tokenizers(demo_tokenizer_dir, tiny_tokenizer_dir):
    oldest = oldest_supported_transformers()
    venv = child_venv_with(f"transformers=={oldest}.*", f"transformers-{oldest}")
    script = venv / "describe_tokenizer.py"
    script.write_text(DESCRIBE)
    paths = [str(demo_tokenizer_dir), str(tiny_tokenizer_dir)]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    child = subprocess.run([str(venv / "bin" / "python"), str(script)],
                           input=json.dumps([paths, SAMPLE_TEXT, TOOLS, CONVERSATION]),
                           capture_output=True, text=True, timeout=300, env=env)
    assert child.returncode == 0, child.stderr[-3000:]
    version = subprocess.run([str(venv / "bin" / "python"), "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, env=env).stdout.strip()
    assert version.startswith(oldest + "."), version

    seen_there = json.loads(child.stdout.strip().splitlines()[-1])
    seen_here = [describe_here(Path(path)) for path in paths]
    assert seen_there == seen_here
    assert seen_here[0]["length"] == demo_tokenizer_spec().vocab_size
    assert "<tool_call>" in seen_here[0]["chat_with_tools"]
