"""The pieces of a prefill/decode KV transfer on their own (the engines in test_pd_engine.py):

- the re-sharding plan covers a decode rank's (layers x KV heads) with the prefill ranks' pieces:
  attention TP 2 -> 1 and 1 -> 2, layers straddling pipeline stages, MLA's replicated latent spread
  over ranks; incompatible caches are refused naming why;
- a handle is checked before anything connects: its MAC (another key, a moved endpoint) and the
  prompt it belongs to; a malformed one is refused;
- a block server answers only holders of the deployment's key, and only pulls of what it holds
  (layers, heads, the request's blocks), of a request still parked;
- a puller waits a moment for a prefill rank that parks the request a step after the rank that
  reported it (a race seen under load), and fails the import, naming why, when it never does.
"""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq

from moe_runtime.errors import InvalidRequestError
from moe_runtime.disaggregation.kv_transfer.block_server import KVBlockServer
from moe_runtime.disaggregation.kv_transfer.handle import HandleError, KVHandle, prompt_digest
from moe_runtime.disaggregation.kv_transfer.keys import TransferKey
from moe_runtime.disaggregation.kv_transfer.messages import KVCodec, PullBlocks
from moe_runtime.disaggregation.kv_transfer.plan import plan_pulls
from moe_runtime.disaggregation.kv_transfer.puller import NOT_PARKED_GRACE_S, KVPuller, PullJob
from moe_runtime.disaggregation.kv_transfer.registry import ExportRegistry
from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError, KVShard
from moe_runtime.disaggregation.kv_transfer.sockets import curve_client
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache


def test_plan_re_shards_heads_and_layers():
    def shard(first_layer, layers, head_start, heads, total=4, endpoint="x"):
        return KVShard(endpoint=endpoint, first_layer=first_layer, num_layers=layers, head_start=head_start,
                       num_heads=heads, total_heads=total, key_dim=8, value_dim=8, block_size=16, dtype="float32")

    tp2 = [shard(0, 4, 0, 2, endpoint="a"), shard(0, 4, 2, 2, endpoint="b")]
    whole = shard(0, 4, 0, 4, endpoint="")
    plan = plan_pulls(whole, tp2)                                   # TP 2 -> 1: both halves, every layer
    assert [(s.shard.endpoint, s.first_layer, s.num_layers, s.head_start, s.num_heads) for s in plan] == [
        ("a", 0, 4, 0, 2), ("b", 0, 4, 2, 2)]
    plan = plan_pulls(shard(0, 4, 2, 2, endpoint=""), [shard(0, 4, 0, 4, endpoint="a")])   # 1 -> 2: a slice
    assert [(s.head_start, s.num_heads) for s in plan] == [(2, 2)]
    stages = [shard(0, 2, 0, 4, endpoint="s0"), shard(2, 2, 0, 4, endpoint="s1")]
    plan = plan_pulls(shard(1, 2, 0, 4, endpoint=""), stages)       # layers 1-2 straddle the two stages
    assert [(s.shard.endpoint, s.first_layer, s.num_layers) for s in plan] == [("s0", 1, 1), ("s1", 2, 1)]
    latent = [shard(0, 4, 0, 1, total=1, endpoint=e) for e in ("a", "b")]   # MLA: every rank holds it whole
    assert {plan_pulls(shard(0, 4, 0, 1, total=1, endpoint=""), latent, spread)[0].shard.endpoint
            for spread in (0, 1)} == {"a", "b"}
    with pytest.raises(KVLayoutError, match="block_size"):
        plan_pulls(whole, [msgspec.structs.replace(tp2[0], block_size=32)])
    with pytest.raises(KVLayoutError, match="layer 2"):
        plan_pulls(whole, [shard(0, 2, 0, 4)])


def test_a_handle_is_checked_before_anything_connects():
    key = TransferKey.from_secret(b"0123456789abcdef0123")
    prompt = [1, 2, 3]
    handle = KVHandle(request_id="r", num_tokens=3, prompt_digest=prompt_digest(prompt), first_token=4,
                      shards=[KVShard(endpoint="tcp://127.0.0.1:1", first_layer=0, num_layers=1, head_start=0,
                                      num_heads=1, total_heads=1, key_dim=8, value_dim=0, block_size=16,
                                      dtype="float32")],
                      release_endpoint="tcp://127.0.0.1:2").signed(key)
    assert KVHandle.from_json_object(handle.to_json_object()).verified(key, prompt) == handle
    moved = msgspec.structs.replace(handle, release_endpoint="tcp://10.0.0.1:2")
    with pytest.raises(HandleError, match="signature"):
        moved.verified(key, prompt)
    with pytest.raises(HandleError, match="signature"):
        handle.verified(TransferKey.from_secret(b"another-deployment-key"), prompt)
    with pytest.raises(HandleError, match="another prompt"):
        handle.verified(key, [1, 2, 4])
    with pytest.raises(InvalidRequestError, match="not a KV handle"):
        KVHandle.from_json_object({"request_id": "r", "shards": "everything"})


def test_the_block_server_answers_only_its_deployment_and_only_what_it_holds():
    key = TransferKey.from_secret(b"0123456789abcdef0123")
    cache = LayerKVCache.allocate(KVCacheSpec(2, 4, 4, head_start=2, total_kv_heads=4), 8, 4, torch.float32, "cpu")
    cache.keys.copy_(torch.arange(cache.keys.numel(), dtype=torch.float32).view_as(cache.keys))
    registry = ExportRegistry()
    registry.park("r", [5, 3], 6)
    shard = KVShard.of([KVCacheSpec(2, 4, 4, head_start=2, total_kv_heads=4)], 0, 4, torch.float32)
    server = KVBlockServer([cache], shard, registry, key, "127.0.0.1")
    codec, context = KVCodec(), zmq.Context()
    try:
        def ask(client_key, **pull):
            socket, _ = curve_client(context, client_key, server.endpoint)
            try:
                socket.send(codec.encode(PullBlocks(request_id="r", pull_id=1, first_layer=0, num_layers=1,
                                                    head_start=2, num_heads=2, first_block=0, num_blocks=2) if not pull
                                         else PullBlocks(**{"request_id": "r", "pull_id": 1, "first_layer": 0,
                                                            "num_layers": 1, "head_start": 2, "num_heads": 2,
                                                            "first_block": 0, "num_blocks": 2, **pull})))
                return socket.recv_multipart() if socket.poll(1000) else None
            finally:
                socket.close(linger=0)

        assert ask(TransferKey.from_secret(b"another-deployment-key")) is None   # no handshake, no answer
        header, keys, values = ask(key)
        assert codec.decode_reply(header).error == ""
        torch.testing.assert_close(torch.frombuffer(bytearray(keys), dtype=torch.float32).view(2, 4, 2, 4),
                                   cache.keys[[5, 3]])
        assert "not all on this rank" in codec.decode_reply(ask(key, head_start=0)[0]).error
        assert "outside the request" in codec.decode_reply(ask(key, num_blocks=3)[0]).error
        assert "no parked KV" in codec.decode_reply(ask(key, request_id="other")[0]).error
        registry.release("r")
        assert "no parked KV" in codec.decode_reply(ask(key)[0]).error
    finally:
        server.close()
        context.term()


def test_a_puller_waits_for_a_rank_that_parks_a_moment_later_and_no_longer():
    key = TransferKey.from_secret(b"0123456789abcdef0123")
    spec = KVCacheSpec(2, 4, 4)
    source = LayerKVCache.allocate(spec, 4, 4, torch.float32, "cpu")
    source.keys.copy_(torch.arange(source.keys.numel(), dtype=torch.float32).view_as(source.keys))
    target = LayerKVCache.allocate(spec, 4, 4, torch.float32, "cpu")
    registry = ExportRegistry()
    server = KVBlockServer([source], KVShard.of([spec], 0, 4, torch.float32), registry, key, "127.0.0.1")
    landed = threading.Event()
    puller = KVPuller([target], KVShard.of([spec], 0, 4, torch.float32), key, on_landed=landed.set)
    try:
        def pull(request_id: str):
            landed.clear()
            puller.submit(PullJob(request_id, "parked-late", [2, 0], 6, plan_pulls(puller.local, [server.shard]), 30))
            assert landed.wait(NOT_PARKED_GRACE_S + 10)
            [result] = puller.take_landed()
            return result

        threading.Timer(0.3, registry.park, ("parked-late", [3, 1], 6)).start()   # this rank is a step behind
        started = time.monotonic()
        assert pull("first").error is None
        torch.testing.assert_close(target.keys[[2, 0]], source.keys[[3, 1]])
        registry.release("parked-late")
        failed = pull("second")                       # released: it never comes back
        assert "no parked KV" in failed.error and time.monotonic() - started >= NOT_PARKED_GRACE_S
    finally:
        puller.close()
        server.close()
