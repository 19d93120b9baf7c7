"""Prefill/decode disaggregation of hybrid models (Qwen3-Next, Qwen3.5-MoE): the prefill instance parks the prompt's
KV blocks (full-attention layers) and its recurrent states (each linear layer's convolution and delta-rule state of
the request's slot); the decode instance pulls both and continues.

- greedy tokens of a P/D pair equal a colocated engine's and transformers', for several requests one after
  another (slots reused on both sides), one whose prompt is several delta-rule chunks long (64 tokens a chunk),
  prefilled whole and in small steps (the state carried across steps before it moves);
- the prefill's blocks and state slots come back once the decode side is done with them, the decode's at the end;
- a decode instance whose linear layers split heads differently (attention TP 2 vs 1) refuses the pull by name
  (the plan, before any byte moves) and computes the prompt itself; the block server refuses state pulls for
  layers it does not keep states of.
"""
from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from lazy_engines import engine_pool
from pd_helpers import (decode, free_blocks, greedy, prefill, run_all_until, run_until, wait_for_blocks_and_slots,
                        wait_for_free)
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from moe_runtime.kernels.delta_rule import DEFAULT_CHUNK
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.disaggregation.kv_transfer.block_server import KVBlockServer
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.messages import PullStates
from moe_runtime.disaggregation.kv_transfer.registry import ExportRegistry
from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError, KVShard
from moe_runtime.disaggregation.kv_transfer.state_plan import plan_state_pulls
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.state_cache import LayerStateCache, StateSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARCHS = ["qwen3_next", "qwen3_5_moe"]
LONG = [(3 * i + 11) % 470 + 8 for i in range(2 * DEFAULT_CHUNK + 23)]   # three delta-rule chunks
PROMPTS = [[5, 17, 42, 99, 3], [(7 * i + 3) % 500 + 5 for i in range(40)], LONG]
NEW_TOKENS = 6
LAYOUTS = {"whole": {"max_num_batched_tokens": 512}, "steps_of_16": {"max_num_batched_tokens": 16}}
ids = itertools.count()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory, kv_key):
    """`engines(arch, mode, layout)`: one engine per (arch, mode, layout) for the module."""
    def build(arch: str, mode: str, layout: str, parallel: tuple):
        return make_engine(EngineConfig(
            model=str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", kv_cache_memory=4 * 2**20,
            max_num_seqs=4, disaggregation_mode=mode, kv_transfer_timeout_s=10.0, **LAYOUTS[layout], **dict(parallel)))

    with engine_pool(build) as pooled:
        yield lambda arch, mode, layout="whole", **parallel: pooled(arch, mode, layout, tuple(sorted(parallel.items())))


def test_the_long_prompt_spans_several_delta_rule_chunks():
    assert len(LONG) > 2 * DEFAULT_CHUNK


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_there_decode_here_equals_one_instance_and_transformers(arch, layout, engines, greedy_oracle):
    want = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    colocated = engines(arch, "none", layout)
    for index, prompt in enumerate(PROMPTS):
        colocated.add_request(f"colocated-{arch}-{layout}-{index}", prompt, greedy(NEW_TOKENS))
    request_ids = [f"colocated-{arch}-{layout}-{i}" for i in range(len(PROMPTS))]
    done = run_all_until([colocated], request_ids, timeout_s=120)
    assert [done[request_id].token_ids for request_id in request_ids] == want
    p, d = engines(arch, "prefill", layout), engines(arch, "decode")
    p_free, d_free = free_blocks(p), free_blocks(d)
    for prompt, tokens in zip(PROMPTS, want):
        first = prefill(p, f"p{next(ids)}", prompt)
        assert first.token_ids == tokens[:1] and first.kv_handle is not None
        assert any(shard["state_layers"] for shard in first.kv_handle.to_json_object()["shards"])
        done = decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
        assert (done.finish_reason, done.token_ids) == ("length", tokens)
    wait_for_blocks_and_slots([(p, p_free), (d, d_free)])


def _shard(heads: int, channels: int, state_layers=(0, 1, 2), endpoint="") -> KVShard:
    specs = [StateSpec(channels, 3, heads, 16, 16) if i in state_layers else KVCacheSpec(2, 16, 16) for i in range(4)]
    return KVShard.of(specs, 0, 16, torch.float32, endpoint)


def test_states_of_a_different_attention_tp_split_are_refused_by_name():
    prefill_tp2 = [_shard(4, 96, endpoint="tcp://a:1"), _shard(4, 96, endpoint="tcp://a:2")]
    with pytest.raises(KVLayoutError, match="different attention-TP splits"):
        plan_state_pulls(_shard(8, 192), prefill_tp2)
    same = plan_state_pulls(_shard(4, 96), prefill_tp2, tp_rank=1)
    assert [(s.shard.endpoint, s.layers) for s in same] == [("tcp://a:2", (0, 1, 2))]


@pytest.mark.parametrize("arch", ARCHS[:1])
def test_an_engine_pair_of_different_attention_tp_names_why_and_runs_the_prompt_on_the_decode_side(
        arch, engines, greedy_oracle, caplog):
    """The plan refuses the pull before any byte moves, naming why; the decode instance then computes the prompt itself
    (nothing is lost, counted as recomputed), with transformers' tokens."""
    p, d = engines(arch, "prefill", ep=2, dp_attn=1), engines(arch, "decode")
    p_free, d_free = free_blocks(p), free_blocks(d)
    before = d.stats().transfer
    first = prefill(p, "tp-p", PROMPTS[1])
    d.add_request("tp-d", PROMPTS[1], greedy(NEW_TOKENS), import_kv=first.kv_handle)
    done = run_until([d, p], "tp-d")
    assert (done.finish_reason, done.token_ids) == ("length", greedy_oracle(arch, PROMPTS[1:2], NEW_TOKENS)[0])
    assert "different attention-TP splits" in caplog.text and "its prompt runs here instead" in caplog.text
    after = d.stats().transfer
    assert (after.recomputed, after.transfers, after.bytes) == (before.recomputed + 1, before.transfers, before.bytes)
    wait_for_free([(p, p_free), (d, d_free)])


def test_the_block_server_answers_states_only_for_its_linear_layers_and_parked_slots(kv_key):
    shard = _shard(2, 48)
    caches = [LayerStateCache.allocate(StateSpec(48, 3, 2, 16, 16), 3, torch.float32, "cpu") if i < 3
              else LayerKVCache.allocate(KVCacheSpec(2, 16, 16), 4, 16, torch.float32, "cpu") for i in range(4)]
    caches[1].ssm[1].normal_()
    registry = ExportRegistry()
    registry.park("r", [0], 5, state_slot=1)
    registry.park("no-slot", [0], 5)
    server = KVBlockServer(caches, shard, registry, TransferKey.from_secret(kv_key.encode()), "127.0.0.1")
    try:
        frames = server.answer(PullStates(request_id="r", pull_id=1, layers=(1,)))
        reply = server.codec.decode_reply(frames[0])
        assert not reply.error and len(frames) == 3
        assert bytes(frames[2]) == caches[1].ssm[1].numpy().tobytes()
        for request_id, layers, why in (("r", (3,), "not linear-attention layers"),
                                        ("no-slot", (0,), "no recurrent-state slot")):
            reply = server.codec.decode_reply(server.answer(PullStates(request_id=request_id, pull_id=2,
                                                                       layers=layers))[0])
            assert why in reply.error
    finally:
        server.close()
    with pytest.raises(msgspec.ValidationError):   # bounded: no unbounded list of layers gets decoded
        server.codec.decode_to_server(server.codec.encode(PullStates(request_id="r", pull_id=3,
                                                                     layers=tuple(range(5000)))))
