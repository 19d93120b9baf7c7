"""Live rebalancing with pipeline stages: each stage balances its own MoE layers over its EP group,
all stages at the same step, and the front hears one merged outcome per rebalance."""
from engine_helpers import PROMPTS, greedy
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM

NEW_TOKENS = 13  # rebalances every 3 steps; the last steps' load is not balanced for yet


def test_pipeline_stages_rebalance_together_and_keep_greedy_tokens(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3_moe", num_hidden_layers=4)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    with LLM(str(path), device="cpu", dtype="float32", ep=2, pp=2, num_redundant_experts=2,
             eplb_interval=3, eplb_window=2) as llm:
        engine = llm.engine
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        interval = engine.rebalance_events()
        assert interval and all(e.ok and e.trigger == "interval" for e in interval), interval
        before = llm.expert_load().placement
        assert before.shape[0] == 4, "the MoE layers of both stages"
        failed = llm.rebalance_now(fail_on_rank=3)  # a rank of the last stage: every stage rolls back
        assert not failed.ok and failed.experts_moved == 0 and "rank 3" in failed.error, failed
        assert (llm.expert_load().placement == before).all(), "a failed migration changed the placement"
        done = llm.rebalance_now()
        assert done.ok and done.experts_moved > 0, done
        assert 0 < done.balancedness_before <= 1 and 0 < done.balancedness_after <= 1
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        events = engine.rebalance_events()
    assert [e.index for e in events] == list(range(len(events))), "one outcome per rebalance"
    assert done in events


def test_a_stage_without_moe_layers_does_not_stop_the_others_from_balancing(tiny_checkpoint_factory):
    """DeepSeek-V3's first layer is dense: with pp_layers (1, 2) stage 0 holds no MoE layer. Its ranks join
    every agreement of a rebalance and move nothing; stage 1 balances its two MoE layers."""
    path = tiny_checkpoint_factory("deepseek_v3")
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    with LLM(str(path), device="cpu", dtype="float32", ep=2, pp=2, pp_layers=(1, 2), num_redundant_experts=2,
             eplb_interval=3, eplb_window=2) as llm:
        engine = llm.engine
        before = llm.expert_load().placement
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        events = engine.rebalance_events()
        assert events and all(e.ok and e.trigger == "interval" for e in events), events
        assert any(e.experts_moved > 0 for e in events), "no rebalance moved anything: the test proves nothing"
        after = llm.expert_load().placement
        assert before.shape == after.shape == (2, 18), "the MoE layers of stage 1 only"
        assert not (after == before).all(), "the stage with MoE layers kept its static placement"
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
