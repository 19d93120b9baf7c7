"""Continuous batching and preemption never change greedy tokens."""
import dataclasses

from engine_helpers import PROMPTS, greedy
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.front.engine_factory import make_engine


def _alone(path, prompts, max_tokens):
    return hf_greedy(path, prompts, max_tokens)


def test_requests_joining_mid_decode_get_their_solo_tokens(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("deepseek_v3")
    expected = _alone(path, PROMPTS, 24)
    engine = make_engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    finished = {}
    engine.add_request("r0", PROMPTS[0], greedy(24))
    arrivals = {3: ("r1", PROMPTS[1]), 7: ("r2", PROMPTS[2]), 8: ("r3", PROMPTS[3])}
    step = 0
    saw_mixed_batch = False
    while engine.has_unfinished() or arrivals:
        if step in arrivals:
            request_id, prompt = arrivals.pop(step)
            engine.add_request(request_id, prompt, greedy(24))
        outputs = engine.step()
        saw_mixed_batch |= len(outputs) > 1
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out.token_ids
        step += 1
    engine.shutdown()
    assert saw_mixed_batch, "requests never shared a decode step"
    assert [finished[f"r{i}"] for i in range(4)] == expected


def test_small_kv_budget_preempts_and_recomputes_to_the_same_tokens(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("mixtral")
    prompts = PROMPTS * 2
    expected = _alone(path, prompts, 40)
    probe = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    bytes_per_token = probe.runner.cache_bytes() // probe.kv_capacity_tokens
    # 8 blocks of 8 tokens: room for the longest request (20 + 40 tokens) alone, not for eight at once.
    budget = bytes_per_token * 64
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=budget, block_size=8) as llm:
        assert llm.core.block_manager.num_blocks == 8
        outputs = llm.generate(prompts, greedy(40))
        assert llm.core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert llm.core.block_manager.num_free_blocks == 8, "blocks leaked"
    assert sum(o.num_preemptions for o in outputs) > 0
    assert [o.token_ids for o in outputs] == expected


def test_eos_ends_a_request_unless_ignore_eos(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3_moe")
    with LLM(str(path), device="cpu") as llm:
        [free_run] = llm.generate([PROMPTS[0]], greedy(20))
        eos = free_run.token_ids[5]
        scheduler = llm.core.scheduler   # the stop checks are the scheduler's
        scheduler.config = dataclasses.replace(scheduler.config, eos_token_ids=(eos,))
        [with_eos] = llm.generate([PROMPTS[0]], greedy(20).__class__(max_tokens=20, temperature=0.0))
        [ignoring] = llm.generate([PROMPTS[0]], greedy(20))
    first = free_run.token_ids.index(eos)
    assert with_eos.token_ids == free_run.token_ids[: first + 1]
    assert with_eos.finish_reason == "stop"
    assert ignoring.token_ids == free_run.token_ids
