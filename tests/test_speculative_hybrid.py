"""Speculative decoding over layers whose cache is more than one paged K/V table: windowed KV groups (gpt-oss's
sliding layers, Llama 4's chunked ones) and recurrent-state layers (Qwen3-Next's and Qwen3.5-MoE's Gated
DeltaNet), exact greedy tokens.

- the block manager (no model): a roll-back gives back the windowed groups' blocks past the accepted tokens
  too, and records how many of the step's tokens the recurrent states must go back over;
- the checkpoint rows: a verify step of 1 + d tokens asks for the states after each prefix it may go back to;
- the engine: greedy tokens with speculation equal transformers' with chunked prefill and prefix caching, drafts
  both accepted and rejected (the counters say so; a state left past a rejected draft changes the tokens), every
  block and slot given back: n-gram over windowed groups; on Qwen3-Next n-gram (whose drafts its random text
  rejects) and a drafter that knows the answer but for chosen positions; n-gram under ep=2 dp_attn=2.
"""
from __future__ import annotations

import pytest

from engine_helpers import greedy
from moe_runtime import LLM
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.records.sequence import Sequence
from moe_runtime.layers.attention_span import AttentionSpan
from moe_runtime.records.draft_checkpoints import DraftCheckpoints

pytestmark = pytest.mark.timeout(600)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
BASE = [5, 17, 42, 99, 3, 8, 61, 200, 31, 7]
PROMPTS = [BASE * 3, [7, 8, 9] * 6 + [1, 2], [400, 12, 250], BASE[::-1] * 2 + [64]]
NEW_TOKENS = 24
SETTINGS = dict(device="cpu", dtype="float32", speculative_config=NGRAM, enable_chunked_prefill=True,
                max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4)


def test_a_roll_back_frees_window_blocks_and_marks_the_states_to_restore():
    manager = BlockManager(16, 4, windows=((AttentionSpan("sliding", 6), 16),), state_slots=2)
    seq = Sequence("a", list(range(1, 10)), greedy(20), arrival=0)
    assert manager.admit(seq)
    manager.schedule_tokens(seq, 9)
    seq.num_scheduled_tokens = 9
    seq.commit_scheduled_tokens()
    seq.output_token_ids.append(50)                          # 10 tokens, 9 computed
    seq.drafts.token_ids = [51, 52, 53, 54]
    manager.append_slot(seq, 4)
    manager.schedule_tokens(seq, 5)
    assert len(seq.kv.window_tables[0]) == 4                    # positions up to 13
    seq.num_scheduled_tokens = 5
    seq.commit_scheduled_tokens()
    seq.output_token_ids.extend([51, 60])                    # one draft accepted, three rejected
    seq.drafts.token_ids = []
    manager.roll_back(seq)
    assert seq.num_cached_tokens == 11 and seq.kv.state_rollback == 3
    assert len(seq.kv.block_table) == 3 and len(seq.kv.window_tables[0]) == 3
    manager.free(seq)
    assert manager.windows[0].pool.num_free_blocks == 16 and manager.states.num_free == 2
    assert seq.kv.state_rollback == -1


def test_a_verify_step_checkpoints_the_states_it_may_go_back_to():
    rows = DraftCheckpoints(first_row=10, per_slot=3)
    # slot 2, 1 + 3 tokens: the states after 3, 2 and 1 of them (1, 2, 3 tokens too many)
    assert rows.captures(2, 3) == [(3, 16), (2, 17), (1, 18)]
    assert rows.row(2, 3) == 18 and rows.rows(4) == 12
    assert rows.captures(0, 1) == [(1, 10)]


def spec_counts(llm: LLM) -> tuple[int, int]:
    workers = llm.engine.stats().workers
    return sum(w.spec_accepted_tokens for w in workers), sum(w.spec_draft_tokens for w in workers)


def assert_nothing_held(llm: LLM) -> None:
    manager = llm.core.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
    assert all(w.pool.num_free_blocks == w.num_blocks for w in manager.windows), "window blocks leaked"
    assert manager.states is None or manager.states.num_free == manager.states.num_slots, "state slots leaked"


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4"])
def test_ngram_greedy_tokens_over_windowed_groups_equal_transformers(arch, tiny_checkpoint_factory, greedy_oracle):
    expected = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    with LLM(str(tiny_checkpoint_factory(arch)), **SETTINGS) as llm:
        cold = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        warm = llm.generate(PROMPTS, greedy(NEW_TOKENS))     # prompts resumed from the prefix cache
        accepted, drafted = spec_counts(llm)
        assert llm.core.block_manager.counters.hits > 0
        assert_nothing_held(llm)
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert 0 < accepted < drafted, "drafts were meant to be both accepted and rejected"


class KnowingDrafter:
    """Proposes the target's own greedy continuation (`expected`), with the draft at every position p where
    p % 3 == `wrong_at` replaced by a wrong token: each step accepts some drafts and rejects the rest, at
    varying depths (the tiny Qwen3-Next's own text never repeats, so prompt lookup would only be rejected)."""

    def __init__(self, prompts: list[list[int]], expected: list[list[int]], wrong_at: int = 1):
        self.runs = [(prompt, prompt + out) for prompt, out in zip(prompts, expected)]
        self.wrong_at = wrong_at

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for prompt, full in self.runs:
            if tokens[: len(prompt)] == prompt and full[: len(tokens)] == tokens:
                drafts = full[len(tokens) : len(tokens) + k]
                return [(t + 1) % 500 if (len(tokens) + j) % 3 == self.wrong_at else t for j, t in enumerate(drafts)]
        return []


def test_recurrent_states_roll_back_to_the_last_accepted_draft(tiny_checkpoint_factory, greedy_oracle):
    expected = greedy_oracle("qwen3_next", PROMPTS, NEW_TOKENS)
    with LLM(str(tiny_checkpoint_factory("qwen3_next")), **SETTINGS) as llm:
        ngram = llm.generate(PROMPTS, greedy(NEW_TOKENS))    # prompt lookup: drafted, all rejected here
        _, ngram_drafted = spec_counts(llm)
        llm.core.speculation.drafter = KnowingDrafter(PROMPTS, expected)
        knowing = llm.generate(PROMPTS, greedy(NEW_TOKENS))  # prompts resumed from the prefix cache
        accepted, drafted = spec_counts(llm)
        assert llm.core.block_manager.counters.hits > 0
        assert_nothing_held(llm)
    assert [o.token_ids for o in ngram] == expected
    assert [o.token_ids for o in knowing] == expected
    assert ngram_drafted > 0
    assert 0 < accepted < drafted - ngram_drafted, "drafts were meant to be both accepted and rejected"


@pytest.mark.slow
def test_recurrent_states_roll_back_under_expert_parallel_lock_step(tiny_checkpoint_factory, greedy_oracle):
    prompts = [BASE * 3, [7, 8, 9] * 6, BASE[::-1] * 2, [400, 12, 250, 400]]   # each drafts at its first decode
    expected = greedy_oracle("qwen3_next", prompts, NEW_TOKENS)
    with LLM(str(tiny_checkpoint_factory("qwen3_next")), ep=2, dp_attn=2, **SETTINGS) as llm:
        outputs = llm.generate(prompts, greedy(NEW_TOKENS))
        workers = llm.engine.stats().workers
    assert [o.token_ids for o in outputs] == expected
    assert all(w.spec_draft_tokens > 0 for w in workers), "each DP worker was meant to draft (and roll back)"
