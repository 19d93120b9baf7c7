"""The transformers oracle's answers kept on disk across runs (oracle_cache.py): a second oracle answers from disk
without loading the model; an entry that does not read back whole and matching is computed again; a changed
checkpoint, prompt or length is another entry; an oracle whose model a caller took stores and reads nothing."""
import json
import shutil

import pytest
import torch
from oracle_cache import CACHE_ENV, checkpoint_digest
from tiny_checkpoints import HFOracle

PROMPTS = [[0, 44, 337, 352], [5, 9, 200]]
NEW_TOKENS = 5


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "oracle"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def live(tiny_checkpoint_factory):
    """The answers computed by transformers, no cache involved."""
    oracle = HFOracle(tiny_checkpoint_factory("llama"), cache=False)
    return oracle.greedy(PROMPTS, NEW_TOKENS), [oracle.prefill_logits(p) for p in PROMPTS]


def _entries(root, suffix):
    return sorted(root.rglob(f"*{suffix}"))


def test_a_second_oracle_answers_from_disk_without_loading_the_model(cache, live, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    first = HFOracle(path)
    assert first.greedy(PROMPTS, NEW_TOKENS) == live[0]
    for prompt, want in zip(PROMPTS, live[1]):
        assert torch.equal(first.prefill_logits(prompt), want)
    assert len(_entries(cache, ".json")) == len(_entries(cache, ".safetensors")) == len(PROMPTS)

    second = HFOracle(path)
    assert second.greedy(PROMPTS, NEW_TOKENS) == live[0]
    for prompt, want in zip(PROMPTS, live[1]):
        assert torch.equal(second.prefill_logits(prompt), want)
    assert second._model is None   # every answer came from disk
    assert second.greedy(PROMPTS[:1], NEW_TOKENS - 1) == [live[0][0][:-1]]   # another length: computed
    assert second._model is not None and len(_entries(cache, ".json")) == len(PROMPTS) + 1


@pytest.mark.parametrize("damage", ["truncated", "payload altered", "another key's entry", "not the format"])
def test_a_damaged_entry_is_computed_again_and_replaced(damage, cache, live, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    HFOracle(path).greedy(PROMPTS, NEW_TOKENS)
    for prompt in PROMPTS:
        HFOracle(path).prefill_logits(prompt)
    tokens_files, logits_files = _entries(cache, ".json"), _entries(cache, ".safetensors")
    for files in (tokens_files, logits_files):
        first, second = files
        if damage == "truncated":
            first.write_bytes(first.read_bytes()[: len(first.read_bytes()) // 2])
        elif damage == "payload altered":
            data = bytearray(first.read_bytes())
            if first.suffix == ".json":
                entry = json.loads(data)
                entry["tokens"][0] = (entry["tokens"][0] + 1) % 512
                data = bytearray(json.dumps(entry).encode())
            else:
                data[-4:] = bytes(b ^ 0x55 for b in data[-4:])   # the last logit's bytes
            first.write_bytes(bytes(data))
        elif damage == "another key's entry":
            shutil.copy(second, first)
        else:
            first.write_bytes(b"\x00" * 64)
    oracle = HFOracle(path)
    assert oracle.greedy(PROMPTS, NEW_TOKENS) == live[0]
    for prompt, want in zip(PROMPTS, live[1]):
        assert torch.equal(oracle.prefill_logits(prompt), want)
    assert oracle._model is not None   # the damaged ones were computed
    reread = HFOracle(path)              # ... and replaced by whole entries
    assert reread.greedy(PROMPTS, NEW_TOKENS) == live[0]
    assert all(torch.equal(reread.prefill_logits(p), want) for p, want in zip(PROMPTS, live[1]))
    assert reread._model is None


def test_a_changed_checkpoint_is_another_key(cache, tiny_checkpoint_factory, tmp_path):
    path = tiny_checkpoint_factory("llama")
    HFOracle(path).greedy(PROMPTS, NEW_TOKENS)
    changed = shutil.copytree(path, tmp_path / "changed")
    assert checkpoint_digest(changed) == checkpoint_digest(path)   # the same files: the same key
    config = json.loads((changed / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (changed / "config.json").write_text(json.dumps(config))
    assert checkpoint_digest(changed) != checkpoint_digest(path)
    oracle = HFOracle(changed)
    oracle.greedy(PROMPTS, NEW_TOKENS)
    assert oracle._model is not None and len(_entries(cache, ".json")) == 2 * len(PROMPTS)
    before = checkpoint_digest(changed)
    weights = next(changed.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1   # one bit of one weight
    weights.write_bytes(bytes(data))
    assert checkpoint_digest(changed) not in (before, checkpoint_digest(path))


def test_an_oracle_whose_model_was_taken_computes_and_stores_nothing(cache, live, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    HFOracle(path).greedy(PROMPTS, NEW_TOKENS)
    stored = _entries(cache, ".json")
    oracle = HFOracle(path)
    with torch.no_grad():
        oracle.model.lm_head.weight.mul_(-1)   # what a caller may do to the model it took
    assert oracle.greedy(PROMPTS, NEW_TOKENS) != live[0]   # computed with the changed model, not read
    assert not torch.equal(oracle.prefill_logits(PROMPTS[0]), live[1][0])
    assert _entries(cache, ".json") == stored and not _entries(cache, ".safetensors")
    assert HFOracle(path).greedy(PROMPTS, NEW_TOKENS) == live[0]   # the stored answers are untouched


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch, live, tiny_checkpoint_factory):
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert HFOracle(tiny_checkpoint_factory("llama")).greedy(PROMPTS, NEW_TOKENS) == live[0]
    assert not list(tmp_path.rglob("*.json"))
