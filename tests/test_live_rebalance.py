"""Live rebalancing: moves experts while requests decode, never changes their tokens, rolls back on failure."""
import json

import pytest

from engine_helpers import PROMPTS, greedy
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def expected(checkpoint):
    return hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


def test_rebalances_during_decoding_keep_greedy_tokens(checkpoint, expected):
    """Every 6 steps a rebalance plans from the window and moves weights, one MoE layer per step."""
    with LLM(str(checkpoint), device="cpu", dtype="float32", ep=2, dp_attn=2, num_redundant_experts=2,
             eplb_interval=6, eplb_layers_per_step=1, eplb_window=8) as llm:
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        events = llm.engine.rebalance_events()
        assert [o.token_ids for o in outputs] == expected
        assert len(events) >= 2 and all(e.ok for e in events), events
        assert any(e.experts_moved > 0 for e in events), "no rebalance moved anything: the test proves nothing"
        assert [e.index for e in events] == list(range(len(events)))
        assert all(e.duration_s > 0 and e.trigger == "interval" for e in events)
        placement = llm.expert_load().placement
        assert not (placement == placement[:, :1].new_tensor(range(placement.shape[1])) % 8).all(), \
            "the placement in force is still the static one"


def test_manual_rebalance_and_injected_failure(checkpoint, expected):
    with LLM(str(checkpoint), device="cpu", dtype="float32", ep=2, dp_attn=1, num_redundant_experts=2) as llm:
        engine = llm.engine
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        before = llm.expert_load()
        failed = llm.rebalance_now(fail_on_rank=1)
        assert not failed.ok and failed.experts_moved == 0 and "rank" in failed.error
        assert (llm.expert_load().placement == before.placement).all(), "a failed migration changed the placement"
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        done = llm.rebalance_now()
        assert done.ok and done.experts_moved > 0
        assert done.balancedness_after >= done.balancedness_before
        assert not (llm.expert_load().placement == before.placement).all()
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        assert [e.ok for e in engine.rebalance_events()] == [False, True]


def test_expert_load_counts_every_routed_token(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    top_k, experts = config["num_experts_per_tok"], config["num_local_experts"]
    with LLM(str(checkpoint), device="cpu", dtype="float32", ep=2, dp_attn=2, eplb_window=1000) as llm:
        llm.generate(PROMPTS, greedy(8))
        snapshot = llm.expert_load()
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (8 - 1)  # prefill + decode steps (last token not fed)
    assert snapshot.counts.shape == (config["num_hidden_layers"], experts)
    assert snapshot.counts.sum(dim=1).tolist() == [tokens * top_k] * 2
    assert snapshot.rank_load.sum(dim=1).tolist() == [tokens * top_k] * 2
    assert ((snapshot.balancedness > 0) & (snapshot.balancedness <= 1)).all()


def test_threshold_trigger_rebalances_when_balance_drops(checkpoint):
    """Balancedness is checked every 32 steps; below the threshold a rebalance starts by itself."""
    with LLM(str(checkpoint), device="cpu", dtype="float32", ep=2, dp_attn=2, num_redundant_experts=2,
             eplb_threshold=0.999, eplb_window=64) as llm:
        before = llm.expert_load()
        llm.generate(PROMPTS, greedy(40))
        events = llm.engine.rebalance_events()
        assert events and events[0].trigger == "threshold" and events[0].ok, events
        assert events[0].balancedness_before < 0.999
        assert not (llm.expert_load().placement == before.placement).all()
