"""Sleep and wake (issue 54 item 3): level 1 frees the KV pool, level 2 drops the weights too; wake_up restores
both and the greedy tokens are exactly those before; requests while asleep are refused. Memory is measured per
rank: the engine's tensor bytes (KV pool, weights) and the process's resident set."""
from __future__ import annotations

import pytest
import torch

from moe_runtime import LLM, SamplingParams
from moe_runtime.front.weight_sync import EngineAsleepError
from moe_runtime.errors import InvalidRequestError

PROMPT = list(range(5, 5 + 12))
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
KV_BYTES = 96 * 2**20


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_factory):
    # wide enough that its weights show in the process's RSS (about 30 MiB of fp32 experts)
    path = tiny_checkpoint_factory("mixtral", hidden_size=256, intermediate_size=1024)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=KV_BYTES) as engine:
        yield engine


def touch_kv_pool(llm) -> None:
    """Every page of the pool resident, as after long serving (a fresh pool's pages are not until written)."""
    for cache in llm.core.runner.caches:
        cache.keys.add_(0.0)
        cache.values.add_(0.0)


def test_sleep_level_1_frees_the_kv_pool(llm):
    before_tokens = llm.generate([PROMPT], GREEDY)[0].token_ids
    touch_kv_pool(llm)
    before = llm.wake_up().memory[0]       # awake already: restores nothing, reports what each rank holds
    asleep = llm.sleep(level=1).memory[0]
    assert before.kv_cache_bytes >= KV_BYTES * 0.9 and asleep.kv_cache_bytes == 0
    assert asleep.weight_bytes == before.weight_bytes > 0   # a CPU engine's weights already live in host memory
    assert before.rss_bytes - asleep.rss_bytes >= 0.8 * before.kv_cache_bytes
    with pytest.raises(EngineAsleepError, match="asleep"):
        llm.generate([PROMPT], GREEDY)
    woken = llm.wake_up().memory[0]
    assert woken.kv_cache_bytes == before.kv_cache_bytes and woken.sleep_level == 0
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == before_tokens


def test_sleep_level_2_drops_the_weights(llm):
    before_tokens = llm.generate([PROMPT], GREEDY)[0].token_ids
    before = llm.wake_up().memory[0]
    asleep = llm.sleep(level=2).memory[0]
    assert asleep.weight_bytes == 0 and asleep.kv_cache_bytes == 0
    assert before.rss_bytes - asleep.rss_bytes >= 0.8 * before.weight_bytes
    with pytest.raises(InvalidRequestError, match="wake_up\\(reload=True\\)"):
        llm.wake_up()
    with pytest.raises(InvalidRequestError, match="level"):
        llm.sleep(level=3)
    woken = llm.wake_up(reload=True).memory[0]
    assert woken.weight_bytes == before.weight_bytes
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == before_tokens


def test_a_failed_reload_leaves_the_weights_dropped(llm, tmp_path, monkeypatch):
    """wake_up(reload=True) whose checkpoint is gone for a moment is refused, and the weights stay dropped: a plain
    wake_up is refused too (no uninitialized memory served), until a reload succeeds."""
    before_tokens = llm.generate([PROMPT], GREEDY)[0].token_ids
    llm.sleep(level=2)
    updater = llm.core.weight_updater
    monkeypatch.setattr(updater, "directory", tmp_path / "moved")   # where the weights last came from, gone now
    with pytest.raises(InvalidRequestError, match="moved does not exist"):
        llm.wake_up(reload=True)
    with pytest.raises(InvalidRequestError, match="wake_up\\(reload=True\\)"):
        llm.wake_up()
    assert llm.core.sleep_mode.memory(0).weight_bytes == 0   # dropped again, not left allocated
    monkeypatch.undo()
    llm.wake_up(reload=True)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == before_tokens


def test_a_full_update_brings_dropped_weights_back(llm):
    before_tokens = llm.generate([PROMPT], GREEDY)[0].token_ids
    llm.sleep(level=2)
    with pytest.raises(InvalidRequestError, match="only a full checkpoint brings them back"):
        llm.update_weights_from_tensors({"lm_head.weight": torch.zeros(1)})
    restored = llm.update_weights(llm.config.model).memory[0]
    assert restored.weight_bytes > 0 and restored.kv_cache_bytes == 0   # the weights are back, the pool not yet
    llm.wake_up()
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == before_tokens
