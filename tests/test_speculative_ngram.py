"""N-gram (prompt lookup) speculative decoding (issue 35, first slice): exact greedy tokens.

- the drafter (no model): vLLM's rule, the longest suffix n-gram within [min, max] at its latest earlier
  occurrence, and the k tokens that followed it;
- the config: vLLM's names through `LLM` and `moe-serve --speculative-config`; an unknown method refused by
  name (windowed groups and recurrent states: tests/test_speculative_hybrid.py; eagle3:
  tests/test_speculative_eagle3.py; pipeline stages: tests/test_speculative_pipeline.py);
- the scheduler and block manager (no model): a drafting sequence gets 1 + d tokens and their blocks, the
  drafts are never offered to the prefix cache, and a roll-back frees the blocks past the accepted tokens;
- the engine: greedy tokens with speculation equal those without it (and transformers') for a dense and an
  MoE model, on prompts that repeat themselves (drafts are accepted: the engine's counters say so), with
  chunked prefill and prefix caching, under preemption, and with ep=2, dp_attn=2 in lock-step (the workers
  accept different numbers of tokens in the same step), and with the captured decode step (verify steps of
  sum(1 + d) single-query rows through its graphs). Sampled requests: tests/test_speculative_sampling.py.
"""
from __future__ import annotations

import json
import pytest

from engine_helpers import greedy
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.engine.core import EngineCore
from moe_runtime.engine.scheduler import Scheduler, SchedulerConfig
from moe_runtime.records.sequence import Sequence
from moe_runtime.errors import InvalidRequestError
from moe_runtime.config.speculative import SpeculativeConfig
from moe_runtime.speculative.ngram import NgramDrafter
from moe_runtime.speculative.speculation import Speculation

pytestmark = pytest.mark.timeout(600)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
BASE = [5, 17, 42, 99, 3, 8, 61, 200, 31, 7]
PROMPTS = [BASE * 4, [7, 8, 9] * 6 + [1, 2], [400, 12, 250], BASE[::-1] * 3 + [64]]   # most repeat themselves
NEW_TOKENS = 40


# ---- the drafter -----------------------------------------------------------------------------------------
def test_the_drafter_proposes_what_followed_the_longest_latest_suffix_match():
    drafter = NgramDrafter(min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2]
    assert drafter.propose(tokens, 2) == [3, 4]        # "1 2" occurs at 4..5 (latest) and 0..1: the latest wins
    assert drafter.propose(tokens, 9) == [3, 4, 5, 1, 2]
    assert NgramDrafter(3, 3).propose(tokens, 2) == []  # no earlier "5 1 2"
    assert drafter.propose([6, 7, 8], 2) == []          # nothing repeats
    longest = [4, 5, 6, 0, 5, 6, 1, 4, 5, 6]             # "4 5 6" beats the later "5 6"
    assert drafter.propose(longest, 1) == [0]
    assert drafter.propose(tokens, 0) == []


# ---- the config ------------------------------------------------------------------------------------------
def test_the_config_takes_vllms_names_and_refuses_what_is_not_built_by_name():
    config = SpeculativeConfig.parse(NGRAM)
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 1, 3)
    assert SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 5}).prompt_lookup_min == 5
    with pytest.raises(InvalidRequestError, match="medusa"):
        EngineConfig(model="m", speculative_config={"method": "medusa"}).validate_options()
    with pytest.raises(InvalidRequestError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    assert Speculation.for_engine(None, 1, 64) is None


def test_moe_serve_takes_speculative_config_json():
    from moe_runtime.server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["--model", "m", "--speculative-config", json.dumps(NGRAM)])
    assert engine_config_from_args(args).speculative_config == NGRAM
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--speculative-config", "[1]"])


# ---- the scheduler and the block manager -----------------------------------------------------------------
class FixedDrafts:
    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def drafts_for(self, seq: Sequence, budget: int) -> list[int]:
        return self.drafts[:budget]


def test_a_drafting_sequence_schedules_its_drafts_and_rolls_back_what_was_rejected():
    manager = BlockManager(8, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=True), manager,
                          FixedDrafts([9, 9, 9, 9, 9]))
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 7], greedy(20), arrival=0)
    scheduler.add(seq)
    assert scheduler.schedule().seqs == [seq] and seq.num_scheduled_tokens == 7
    seq.commit_scheduled_tokens()
    seq.output_token_ids.append(8)                          # 8 tokens: blocks 0, 1 full, the 8th not computed
    batch = scheduler.schedule()
    assert batch.phase == "decode", "a step of decodes verifying drafts is a decode step (drafts within its bound)"
    assert seq.num_scheduled_tokens == 6 and seq.scheduled_token_ids() == [8, 9, 9, 9, 9, 9]
    assert seq.samples_this_step and seq.logit_rows == 6
    assert len(seq.kv.block_table) == 4                        # positions up to 12 (7 + 1 + 5 drafts)
    assert seq.kv.num_registered_blocks == 2                   # the drafts' blocks are not cached
    seq.commit_scheduled_tokens()
    seq.output_token_ids.extend([9, 5])                     # one draft accepted, then the target's own token
    seq.drafts.token_ids = []
    manager.roll_back(seq)
    assert seq.num_cached_tokens == seq.num_tokens - 1 == 9 and seq.is_decoding
    assert len(seq.kv.block_table) == 3 and manager.num_free_blocks == 5


def test_drafts_wait_for_free_blocks_rather_than_preempt():
    manager = BlockManager(2, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager, FixedDrafts([9, 9, 9, 9, 9]))
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 7], greedy(20), arrival=0)
    scheduler.add(seq)
    scheduler.schedule()
    seq.commit_scheduled_tokens()
    seq.output_token_ids.append(8)
    scheduler.schedule()
    assert seq.num_scheduled_tokens == 1 and not seq.drafts.token_ids and scheduler.num_preemptions == 0


# ---- the engine ------------------------------------------------------------------------------------------
def spec_llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", speculative_config=NGRAM, **kwargs)


def accepted_and_drafted(llm: LLM) -> tuple[int, int]:
    workers = llm.engine.stats().workers
    return sum(w.spec_accepted_tokens for w in workers), sum(w.spec_draft_tokens for w in workers)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_tokens_with_speculation_equal_transformers_with_chunked_prefill_and_prefix_caching(
        arch, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    with spec_llm(path, enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True,
                  block_size=4) as llm:
        cold = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        warm = llm.generate(PROMPTS, greedy(NEW_TOKENS))   # the prompts' blocks come from the prefix cache
        accepted, drafted = accepted_and_drafted(llm)
        stats = llm.engine.stats()
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert 0 < accepted < drafted
    assert stats.prefix_cache_hits > 0
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers), "blocks leaked"


def test_greedy_tokens_with_speculation_hold_under_preemption(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("mixtral")
    prompts = PROMPTS * 2
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    probe = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    budget = probe.runner.cache_bytes() // probe.kv_capacity_tokens * 96   # 12 blocks of 8: not all 8 at once
    with spec_llm(path, kv_cache_memory=budget, block_size=8, enable_chunked_prefill=False) as llm:
        outputs = llm.generate(prompts, greedy(NEW_TOKENS))
        accepted, _ = accepted_and_drafted(llm)
        assert llm.core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert llm.core.block_manager.num_free_blocks == 12, "blocks leaked"
    assert [o.token_ids for o in outputs] == expected
    assert accepted > 0


def test_expert_parallel_lock_step_with_speculation_gives_the_same_greedy_tokens(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3_moe")
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6] * 3]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    with spec_llm(path, ep=2, dp_attn=2, enable_chunked_prefill=True, max_num_batched_tokens=16,
                  enable_prefix_caching=True, block_size=4) as llm:
        outputs = llm.generate(prompts, greedy(NEW_TOKENS))
        workers = llm.engine.stats().workers
    assert [o.token_ids for o in outputs] == expected
    assert all(w.spec_draft_tokens > 0 for w in workers), "each DP worker was meant to draft"
    assert sum(w.spec_accepted_tokens for w in workers) > 0
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"


def test_verify_steps_run_through_the_captured_decode_step(tiny_checkpoint_factory, greedy_oracle):
    """Every decode step, verifying or not, runs through a graph (dynamo's full-graph trace, "eager" backend):
    rows of sequences with and without drafts side by side, padded to the row bucket."""
    arch = "qwen3_moe"
    expected = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    with spec_llm(tiny_checkpoint_factory(arch), enable_torch_compile=True, torch_compile_backend="eager",
                  torch_compile_max_bs=16) as llm:
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        accepted, drafted = accepted_and_drafted(llm)
        stats = llm.core.runner.capture.stats
    assert [o.token_ids for o in outputs] == expected
    assert stats.disabled_reason is None
    assert stats.captured_verify_steps > 0 and stats.eager_steps == 1, "only the prefill step was meant to be eager"
    assert 0 < accepted < drafted
