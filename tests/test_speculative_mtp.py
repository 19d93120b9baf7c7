"""MTP speculative decoding: DeepSeek-V3's multi-token-prediction layer drafts, the target verifies.

- the drafts are the MTP layer's: after every step (the prefill, then steps that verified drafts and rolled
  back the rejected ones, with the prompt prefilled whole or in chunks) the drafter's k drafts equal what
  transformers' decoder layer and norms compute from the module's definition over the whole sequence, with
  the checkpoint's own embedding / head copies and without them (the target's then);
- greedy tokens with `mtp` equal transformers' without speculation, with chunked prefill and prefix caching,
  and the engine's counters show the drafts were verified; FP8 checkpoints draft through the same loader,
  dequantized or kept FP8 (`--quantization fp8`: the MTP layer's projections stay FP8);
- with the captured decode step (verify steps included) the drafts read its hidden states and are still the
  MTP layer's, and greedy tokens are unchanged;
- under preemption (blocks freed and taken by others, positions recomputed) greedy tokens are unchanged;
- under ep=2 with dp_attn=2 or 1 (lock-step, the MTP layer's experts spread over the ranks, its heads split
  under attention TP) greedy tokens are unchanged;
- seeded sampled requests draft and give the same tokens run to run; the MTP layer's KV cache is paid from
  `kv_cache_memory` (one layer's worth per block beside the target's);
- `mtp` is refused by name for a model without MTP layers, and for a DeepSeek-V3 checkpoint whose config names
  one but whose files hold none.
"""
from __future__ import annotations

import pytest

from engine_helpers import greedy
from fp8_checkpoints import write_fp8_checkpoint
from mtp_checkpoints import MtpReference, run_checking_drafts
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.errors import InvalidRequestError
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

pytestmark = pytest.mark.timeout(600)

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K}
PROMPTS = [[5, 17, 42, 99, 3, 8, 61, 200, 31, 7] * 2, [7, 8, 9] * 6 + [1, 2], [400, 12, 250]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def mtp_checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """own copies (embedding, head) or not -> (DeepSeek-V3 checkpoint with an MTP layer, the same without it)."""
    base = tiny_checkpoint_factory("deepseek_v3")
    root = tmp_path_factory.mktemp("mtp")
    return {own: (write_mtp_checkpoint(base, root / f"own-{own}", own_copies=own), base) for own in (False, True)}


@pytest.mark.parametrize("own_copies", [False, True])
@pytest.mark.parametrize("chunk", [None, 8])
def test_the_drafts_are_the_mtp_layers_after_every_step(mtp_checkpoints, own_copies, chunk):
    path, _ = mtp_checkpoints[own_copies]
    reference = MtpReference(path)
    options = dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk) if chunk else {}
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=MTP,
                                   block_size=4, **options))
    core.add_request("r", PROMPTS[0], greedy(12))
    assert run_checking_drafts(core, reference, K) >= 3
    stats = core.worker_stats()
    assert stats.spec_draft_tokens > 0
    core.shutdown()


def test_greedy_tokens_with_mtp_equal_transformers_with_chunked_prefill_and_prefix_caching(mtp_checkpoints):
    path, base = mtp_checkpoints[False]
    expected = hf_greedy(base, PROMPTS, NEW_TOKENS)
    with LLM(str(path), device="cpu", dtype="float32", speculative_config=MTP, enable_chunked_prefill=True,
             max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4) as llm:
        cold = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        warm = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        stats = llm.engine.stats()
    assert cold == expected and warm == expected
    worker = stats.workers[0]
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0
    assert stats.prefix_cache_hits > 0
    assert worker.kv_blocks_free == worker.kv_blocks_total, "blocks leaked"


def test_mtp_drafts_from_the_captured_decode_steps_hidden_states(mtp_checkpoints):
    path, base = mtp_checkpoints[False]
    prompts = PROMPTS[:1]   # rows 1 + d <= 4: three buckets traced
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=MTP,
                                   block_size=4, enable_torch_compile=True, torch_compile_backend="eager",
                                   torch_compile_max_bs=4))
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, greedy(12))
    seqs = list(core._sequences.values())
    assert run_checking_drafts(core, MtpReference(path), K) >= 2 * len(prompts)
    stats = core.runner.capture.stats
    core.shutdown()
    assert [seq.output_token_ids for seq in seqs] == hf_greedy(base, prompts, 12)
    assert stats.disabled_reason is None and stats.captured_verify_steps > 0


def test_seeded_sampling_with_mtp_is_reproducible_and_the_mtp_cache_is_paid_from_the_kv_budget(mtp_checkpoints):
    path, _ = mtp_checkpoints[False]
    params = [SamplingParams(max_tokens=16, temperature=0.7, seed=3 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    budget = 1 << 20
    with LLM(str(path), device="cpu", dtype="float32", speculative_config=MTP, kv_cache_memory=budget) as llm:
        first = [o.token_ids for o in llm.generate(PROMPTS, params)]
        second = [o.token_ids for o in llm.generate(PROMPTS, params)]
        drafted = llm.engine.stats().workers[0].spec_draft_tokens
        core = llm.core
        target_bytes, drafter = core.runner.cache_bytes(), core.speculation.model_drafter
        drafter_bytes = drafter.cache.keys.numel() * drafter.cache.keys.element_size()
        blocks = core.block_manager.num_blocks
    assert first == second
    assert drafted > 0
    layers = 3                                                   # the target's: the MTP layer is one more
    assert drafter_bytes * layers == target_bytes
    assert target_bytes + drafter_bytes <= budget
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=budget) as plain:
        assert plain.core.block_manager.num_blocks * layers // (layers + 1) in (blocks, blocks + 1)


def test_greedy_tokens_with_mtp_hold_under_preemption(mtp_checkpoints):
    """Preempted requests free their blocks (the MTP layer's rows in them too) and are recomputed: the MTP pass
    runs again over the recomputed positions and the outputs stay transformers'."""
    path, base = mtp_checkpoints[False]
    prompts = PROMPTS * 2
    expected = hf_greedy(base, prompts, NEW_TOKENS)
    probe = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=MTP))
    drafter_cache = probe.speculation.model_drafter.cache
    per_token = ((probe.runner.cache_bytes() + drafter_cache.keys.numel() * drafter_cache.keys.element_size())
                 // probe.kv_capacity_tokens)
    probe.shutdown()
    with LLM(str(path), device="cpu", dtype="float32", speculative_config=MTP, kv_cache_memory=per_token * 96,
             block_size=8, enable_chunked_prefill=False) as llm:   # 12 blocks of 8: not all 6 requests at once
        outputs = [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))]
        core = llm.core
        assert core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert core.block_manager.num_blocks == 12 and core.block_manager.num_free_blocks == 12, "blocks leaked"
        assert core.worker_stats().spec_draft_tokens > 0
    assert outputs == expected


@pytest.mark.parametrize("dp_attn", [2, 1])
def test_expert_parallel_lock_step_with_mtp_gives_the_same_greedy_tokens(mtp_checkpoints, dp_attn):
    """ep=2, dp_attn=2: each DP worker drafts for its own requests, the MTP layer's experts spread over both ranks
    (its pass and chain run on both every step, with no rows on a worker that has none); dp_attn=1: one worker
    whose two ranks split the attention heads, the MTP layer's too."""
    path, base = mtp_checkpoints[False]
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6] * 3]
    expected = hf_greedy(base, prompts, NEW_TOKENS)
    with LLM(str(path), device="cpu", dtype="float32", speculative_config=MTP, ep=2, dp_attn=dp_attn,
             enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4) as llm:
        outputs = [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))]
        workers = llm.engine.stats().workers
    assert outputs == expected
    assert all(w.spec_draft_tokens > 0 for w in workers), "each DP worker was meant to draft"
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"


def test_an_fp8_checkpoint_drafts_with_its_mtp_layer(tiny_checkpoint_factory, tmp_path):
    """Dequantized at load (the MTP layer's FP8 tensors and their `weight_scale_inv` read like the target's: its
    drafts are those of the dequantized layer), and kept FP8 in memory (--quantization fp8: the MTP layer's
    eh_proj and block too)."""
    fp8, oracle = write_fp8_checkpoint(tiny_checkpoint_factory("deepseek_v3"), tmp_path / "fp8", tmp_path / "oracle",
                                       (32, 48), with_mtp=True, mtp_oracle_dir=tmp_path / "mtp-oracle")
    core = EngineCore(EngineConfig(model=str(fp8), device="cpu", dtype="float32", speculative_config=MTP,
                                   block_size=4))
    core.add_request("fp8", PROMPTS[0], greedy(6))
    assert run_checking_drafts(core, MtpReference(tmp_path / "mtp-oracle"), K) >= 3
    core.shutdown()
    expected = hf_greedy(oracle, PROMPTS, NEW_TOKENS)
    with LLM(str(fp8), device="cpu", dtype="float32", speculative_config=MTP) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        drafted = llm.engine.stats().workers[0].spec_draft_tokens
    assert outputs == expected
    assert drafted > 0
    with LLM(str(fp8), device="cpu", dtype="float32", quantization="fp8") as kept:
        plain = [o.token_ids for o in kept.generate(PROMPTS, greedy(NEW_TOKENS))]
    with LLM(str(fp8), device="cpu", dtype="float32", quantization="fp8", speculative_config=MTP) as kept:
        speculated = [o.token_ids for o in kept.generate(PROMPTS, greedy(NEW_TOKENS))]
        layer = kept.core.speculation.model_drafter.layer
        drafted = kept.engine.stats().workers[0].spec_draft_tokens
    assert speculated == plain
    assert layer.eh_proj.quant is not None, "the checkpoint stores eh_proj in FP8: it stays FP8"
    assert drafted > 0


def test_mtp_is_refused_by_name_without_mtp_layers(tiny_checkpoint_factory, mtp_checkpoints):
    with pytest.raises(InvalidRequestError, match="LlamaForCausalLM.*no multi-token-prediction layer"):
        EngineCore(EngineConfig(model=str(tiny_checkpoint_factory("llama")), device="cpu", dtype="float32",
                                speculative_config=MTP))
    _, base = mtp_checkpoints[False]                    # its config says num_nextn_predict_layers=1, no tensors
    with pytest.raises(InvalidRequestError, match="DeepseekV3ForCausalLM.*model.layers.3"):
        EngineCore(EngineConfig(model=str(base), device="cpu", dtype="float32", speculative_config=MTP))
