"""Speculative decoding on the decode side of a P/D pair (DeepSeek-V3, GLM-4.5, Qwen3-Next with an MTP layer; an
EAGLE-3 head on Llama).

- MTP on both sides: the prefill instance's MTP layer runs over the prompt, its KV rows travel as one more layer
  and its drafts after the first token in the handle; the decode side's first step verifies those, and after every
  step its drafts equal transformers' MTP reference over the whole sequence (as one instance drafts), its greedy
  tokens transformers' without speculation; so too from a prefill instance under attention TP (GLM-4.5, ep=2
  dp_attn=1: the MTP layer's heads split over its ranks, re-sharded 2 -> 1 by the pull) and for a hybrid model
  (Qwen3-Next: the MTP layer's rows pulled beside the linear layers' recurrent states); EAGLE-3 likewise (a Llama
  target: the head's KV layer is shaped like the target's, so it travels);
- MTP on a decode instance under attention TP (ep=2 dp_attn=1): greedy tokens unchanged;
- MTP on the decode side only (the prefill instance drafts nothing): the drafter layer is planned out of the pull,
  the decode side still drafts and verifies, greedy tokens unchanged; a prefill instance that drafts with MTP
  handing to a decode side without speculation: its drafter layer is not asked for, tokens unchanged;
- n-gram on the decode side (it needs only the prompt tokens, which the import carries): tokens unchanged, drafts
  verified.
"""
from __future__ import annotations

import itertools

import pytest

from lazy_engines import engine_pool
from eagle3_checkpoints import Eagle3Reference, write_eagle3_head
from mtp_checkpoints import MtpReference, Qwen3NextMtpReference
from pd_helpers import decode, free_blocks, greedy, prefill, wait_for_free
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from tiny_checkpoints import hf_greedy
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.disaggregation.kv_transfer.plan import plan_pulls
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K}
NGRAM = {"method": "ngram", "num_speculative_tokens": K}
PROMPTS = [[5, 17, 42, 99, 3, 8, 61, 200, 31, 7] * 2, [7, 8, 9] * 6 + [1, 2]]
NEW_TOKENS = 16   # the first prompt's output repeats a pair: an n-gram draft is accepted
CHECKED_TOKENS = 8   # where the drafts are checked after every step (each check runs the reference whole)
ids = itertools.count()


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """arch -> its tiny checkpoint with an MTP layer appended; "llama" -> a 4-layer Llama (an EAGLE-3 target)."""
    root = tmp_path_factory.mktemp("pd_mtp")
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = (tiny_checkpoint_factory(arch, num_hidden_layers=4) if arch == "llama"
                           else write_mtp_checkpoint(tiny_checkpoint_factory(arch), root / arch))
        return cache[arch]
    return get


@pytest.fixture(scope="module")
def engines(checkpoints, kv_key):
    """`engines(mode, speculative, arch="deepseek_v3", **layout)`: one engine per such key for the module."""
    def build(arch: str, mode: str, speculative: tuple | None, layout: tuple):
        return make_engine(EngineConfig(model=str(checkpoints(arch)), device="cpu", dtype="float32",
                                        block_size=4, kv_cache_memory=2**20, max_num_seqs=4, disaggregation_mode=mode,
                                        speculative_config=dict(speculative) if speculative else None,
                                        **dict(layout)))

    with engine_pool(build) as pooled:
        yield lambda mode, speculative=None, arch="deepseek_v3", **layout: pooled(
            arch, mode, tuple(sorted(speculative.items())) if speculative else None, tuple(sorted(layout.items())))


@pytest.fixture(scope="module")
def expected(greedy_oracle):
    return greedy_oracle("deepseek_v3", PROMPTS, NEW_TOKENS)   # the MTP checkpoint's model, without the layer


def decode_checking_drafts(p, d, prompt: list[int], handle, reference: MtpReference) -> tuple[list[int], int]:
    """Decode on `d`, checking after activation and after every step that its drafts are `reference`'s for where
    the sequence stands; its tokens and how many drafts were compared."""
    request_id = f"d{next(ids)}"
    d.add_request(request_id, prompt, greedy(CHECKED_TOKENS), import_kv=handle)
    compared, seq = 0, None
    while True:
        outputs = d.step() + p.step()
        seq = seq or d.core._sequences.get(request_id)
        done = [o for o in outputs if o.request_id == request_id and o.finished]
        if done:
            return done[0].token_ids, compared
        if seq is not None and seq.drafts.proposed_at == seq.num_tokens and seq.num_cached_tokens == seq.num_tokens - 1:
            expected = reference.drafts(seq.all_token_ids, K)
            assert seq.drafts.proposed == expected[: len(seq.drafts.proposed)], f"after {seq.num_tokens} tokens"
            assert seq.drafts.proposed, "the drafts were cut short"
            compared += 1


@pytest.mark.parametrize("arch, prefill_layout", [("deepseek_v3", {}), ("glm4_moe", {"ep": 2, "dp_attn": 1}),
                                                  ("qwen3_next", {}), ("deepseek_v3", {"pp": 2})])
def test_mtp_on_both_sides_drafts_as_one_instance_and_keeps_the_greedy_tokens(arch, prefill_layout, engines,
                                                                              checkpoints, greedy_oracle, tmp_path):
    path = checkpoints(arch)
    reference = Qwen3NextMtpReference(path, tmp_path) if arch == "qwen3_next" else MtpReference(path)
    p, d = engines("prefill", MTP, arch, **prefill_layout), engines("decode", MTP, arch)
    p_free, d_free = free_blocks(p), free_blocks(d)
    prompts = PROMPTS[:1]   # the drafts checked after every step: one request is enough (the others check tokens)
    for prompt, want in zip(prompts, greedy_oracle(arch, prompts, CHECKED_TOKENS)):
        first = prefill(p, f"p{next(ids)}", prompt)
        handle = first.kv_handle
        # as far as the prompt's blocks reach (the chain writes the layer's cache at each draft's position)
        assert handle.first_drafts and handle.first_drafts == reference.drafts(prompt + want[:1], K)[
            : len(handle.first_drafts)], "the prefill's drafts travel"
        last_stage = max(shard.first_layer for shard in handle.shards)   # under --pp only it holds the layer
        assert all(shard.drafter == ("mtp" if shard.first_layer == last_stage else "") for shard in handle.shards)
        assert all(bool(shard.state_layers) == (arch == "qwen3_next") for shard in handle.shards)
        tokens, compared = decode_checking_drafts(p, d, prompt, handle, reference)
        assert tokens == want
        assert compared >= 3
    assert d.stats().workers[0].spec_verify_steps > 0
    wait_for_free([(p, p_free), (d, d_free)])


def test_eagle3_on_both_sides_drafts_as_one_instance_and_keeps_the_greedy_tokens(engines, checkpoints, tmp_path):
    target = checkpoints("llama")
    head = write_eagle3_head(target, tmp_path / "head", [1, 2, 3])
    eagle3 = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    p, d = engines("prefill", eagle3, "llama"), engines("decode", eagle3, "llama")
    reference = Eagle3Reference(target, head)
    [want] = hf_greedy(target, PROMPTS[:1], CHECKED_TOKENS)
    handle = prefill(p, f"p{next(ids)}", PROMPTS[0]).kv_handle
    assert handle.first_drafts == reference.drafts(PROMPTS[0] + want[:1], K)[: len(handle.first_drafts)]
    assert handle.first_drafts and handle.shards[0].drafter == "eagle3"
    tokens, compared = decode_checking_drafts(p, d, PROMPTS[0], handle, reference)
    assert tokens == want
    assert compared >= 3


def test_mtp_on_a_decode_instance_under_attention_tp_keeps_the_greedy_tokens(engines, expected):
    """Both decode ranks pull the MTP layer's rows and take the handle's drafts, then draft in lock-step."""
    p, d = engines("prefill", MTP), engines("decode", MTP, ep=2, dp_attn=1)
    for prompt, want in zip(PROMPTS, expected):
        first = prefill(p, f"p{next(ids)}", prompt)
        assert decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS).token_ids == want
    assert d.stats().workers[0].spec_verify_steps > 0


def test_mtp_on_one_side_only_keeps_the_greedy_tokens(engines, expected):
    plain_p, mtp_d = engines("prefill"), engines("decode", MTP)
    for prompt, want in zip(PROMPTS, expected):
        first = prefill(plain_p, f"p{next(ids)}", prompt)
        assert first.kv_handle.first_drafts == [] and first.kv_handle.shards[0].drafter == ""
        local = mtp_d.core.transfers.shard()
        assert local.drafter == "mtp"
        assert local.draft_layer not in {layer for piece in plan_pulls(local, first.kv_handle.shards)
                                         for layer in range(piece.first_layer, piece.first_layer + piece.num_layers)}
        drafted = mtp_d.stats().workers[0].spec_draft_tokens
        done = decode(plain_p, mtp_d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
        assert done.token_ids == want
        assert mtp_d.stats().workers[0].spec_draft_tokens > drafted
    mtp_p, plain_d = engines("prefill", MTP), engines("decode")
    first = prefill(mtp_p, f"p{next(ids)}", PROMPTS[0])
    assert plain_d.core.transfers.shard().drafter == ""
    assert decode(mtp_p, plain_d, f"d{next(ids)}", PROMPTS[0], first.kv_handle, NEW_TOKENS).token_ids == expected[0]


def test_ngram_on_the_decode_side_keeps_the_greedy_tokens(engines, expected):
    p, d = engines("prefill"), engines("decode", NGRAM)
    for prompt, want in zip(PROMPTS, expected):
        first = prefill(p, f"p{next(ids)}", prompt)
        done = decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
        assert done.token_ids == want
    worker = d.stats().workers[0]
    assert worker.spec_draft_tokens > 0 and worker.spec_accepted_tokens > 0
