"""The pieces of a prefill/decode KV transfer on their own (the engines in test_pd_engine.py):

- the re-sharding plan covers a decode rank's (layers x KV heads) with the prefill ranks' pieces:
  attention TP 2 -> 1 and 1 -> 2, layers straddling pipeline stages, MLA's replicated latent spread
  over ranks; incompatible caches are refused naming why; a drafter's KV layer (MTP, EAGLE-3) is pulled only from
  prefill ranks that drafted with the same method, and travels only when shaped like the model's layers, from the
  rank holding the model's last layer;
- a handle is checked before anything connects: its MAC (another key, a moved endpoint) and the
  prompt it belongs to; a malformed one is refused;
- every field of a handle is signed (the first token's logprob too) and survives JSON; an expired
  handle is refused; a handle is good for one request: a replay is refused before any transfer, the
  decode front remembers nonces only until their handles expire (and never more than its cap), and a
  refused request frees its prefill's copy at once, but a replayed copy frees nothing;
- a block server answers only holders of the deployment's key, and only pulls of what it holds
  (layers, heads, the request's blocks), of a request still parked;
- a puller waits a moment for a prefill rank that parks the request a step after the rank that
  reported it (a race seen under load), and fails the import, naming why, when it never does.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from moe_runtime.errors import InvalidRequestError, QueueFullError
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from server_harness import FakeEngine
from moe_runtime.disaggregation.kv_transfer.block_server import KVBlockServer
from moe_runtime.disaggregation.decode_front import DecodeFront
from moe_runtime.disaggregation.draft_layer import TransferredLayers
from moe_runtime.disaggregation.kv_transfer.handle import HandleError, HandleLogprob, KVHandle, prompt_digest
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.messages import KVCodec, PullBlocks
from moe_runtime.disaggregation.kv_transfer.plan import plan_pulls
from moe_runtime.disaggregation.kv_transfer.puller import NOT_PARKED_GRACE_S, KVPuller, PullJob
from moe_runtime.disaggregation.kv_transfer.registry import ExportRegistry
from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError, KVShard
from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.disaggregation.kv_transfer.used_nonces import NonceRefused, UsedNonces
from moe_runtime.disaggregation.kv_transfer.sockets import curve_client
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.sampling.params import SamplingParams

KEY = TransferKey.from_secret(b"rtrGEeVCilT80xVvHljgG6XfVkYKTOJP")


def a_handle(prompt: list[int], expires_in_s: float = 30.0, key: TransferKey = KEY) -> KVHandle:
    return KVHandle(request_id="r", num_tokens=len(prompt), prompt_digest=prompt_digest(prompt), first_token=4,
                    first_logprob=HandleLogprob(token_id=4, logprob=-0.1234567891234, top_ids=[4, 9],
                                                top_logprobs=[-0.1234567891234, -2.5]),
                    first_drafts=[7, 3, 5], shards=[KVShard(endpoint="tcp://127.0.0.1:1", first_layer=0, num_layers=1, head_start=0,
                                    num_heads=1, total_heads=1, key_dim=8, value_dim=0, block_size=16,
                                    dtype="float32")],
                    release_endpoint="tcp://127.0.0.1:2", nonce=KVHandle.new_nonce(),
                    expires_at=time.time() + expires_in_s).signed(key)


class RecordedReleases:
    """Stands in for the decode front's ReleaseSender: what it would send, where."""

    def __init__(self):
        self.sent: list[tuple[str, str]] = []

    def send(self, endpoint: str, request_id: str) -> None:
        self.sent.append((endpoint, request_id))

    def close(self) -> None:
        pass


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


def test_a_drafters_layer_comes_only_from_prefill_ranks_drafting_with_the_same_method():
    def shard(layers, head_start=0, heads=4, drafter="", endpoint="x"):
        return KVShard(endpoint=endpoint, first_layer=0, num_layers=layers, head_start=head_start, num_heads=heads,
                       total_heads=4, key_dim=8, value_dim=8, block_size=16, dtype="float32", drafter=drafter)

    def pulled(local, remote):
        return [(s.shard.endpoint, s.first_layer, s.num_layers, s.head_start, s.num_heads)
                for s in plan_pulls(local, remote)]

    mtp = shard(5, drafter="mtp", endpoint="")                     # four model layers, then the MTP layer's
    assert mtp.draft_layer == 4 and mtp.kv_layers == (0, 1, 2, 3, 4) and shard(4).draft_layer is None
    assert pulled(mtp, [shard(5, drafter="mtp", endpoint="a")]) == [("a", 0, 5, 0, 4)]
    assert pulled(mtp, [shard(4, endpoint="a")]) == [("a", 0, 4, 0, 4)]               # it did not draft: left out
    assert pulled(mtp, [shard(5, drafter="eagle3", endpoint="a")]) == [("a", 0, 4, 0, 4)]   # another drafter's
    assert pulled(shard(4, endpoint=""), [shard(5, drafter="mtp", endpoint="a")]) == [("a", 0, 4, 0, 4)]
    tp2 = [shard(5, 0, 2, "mtp", "a"), shard(5, 2, 2, "mtp", "b")]                 # its heads split like the model's
    assert pulled(mtp, tp2) == [("a", 0, 5, 0, 2), ("b", 0, 5, 2, 2)]


def test_a_drafters_layer_travels_when_shaped_like_the_models_from_the_last_layers_rank():
    model = [KVCacheSpec(2, 8, 8)] * 3
    caches = ["c0", "c1", "c2"]

    def speculation(spec: KVCacheSpec, method: str = "mtp"):
        drafter = SimpleNamespace(layer=SimpleNamespace(kv_cache_spec=lambda: spec), cache="draft")
        return SimpleNamespace(local_model_drafter=lambda: drafter, config=SimpleNamespace(method=method))

    layers = TransferredLayers.of(model, caches, speculation(KVCacheSpec(2, 8, 8)), holds_last_layer=True)
    assert (layers.caches, layers.drafter) == ([*caches, "draft"], "mtp")
    assert KVShard.of(layers.specs, 0, 16, torch.float32, drafter=layers.drafter).draft_layer == 3
    for left_out in (TransferredLayers.of(model, caches, speculation(KVCacheSpec(4, 8, 8), "eagle3"), True),
                     TransferredLayers.of(model, caches, speculation(KVCacheSpec(2, 8, 8)), False),
                     TransferredLayers.of(model, caches, SimpleNamespace(local_model_drafter=lambda: None), True),
                     TransferredLayers.of(model, caches, None, True)):
        assert (left_out.caches, left_out.drafter) == (caches, "")


def test_a_handle_is_checked_before_anything_connects():
    key = TransferKey.from_secret(b"rtrGEeVCilT80xVvHljgG6XfVkYKTOJP")
    prompt = [1, 2, 3]
    handle = KVHandle(request_id="r", num_tokens=3, prompt_digest=prompt_digest(prompt), first_token=4,
                      shards=[KVShard(endpoint="tcp://127.0.0.1:1", first_layer=0, num_layers=1, head_start=0,
                                      num_heads=1, total_heads=1, key_dim=8, value_dim=0, block_size=16,
                                      dtype="float32")],
                      release_endpoint="tcp://127.0.0.1:2", nonce=KVHandle.new_nonce(),
                      expires_at=time.time() + 30).signed(key)
    assert KVHandle.from_json_object(handle.to_json_object()).verified(key, prompt) == handle
    moved = msgspec.structs.replace(handle, release_endpoint="tcp://10.0.0.1:2")
    with pytest.raises(HandleError, match="signature"):
        moved.verified(key, prompt)
    with pytest.raises(HandleError, match="signature"):
        handle.verified(TransferKey.from_secret(b"clTPo4KBlyscmZ3elE61BDUjuyDUURb5"), prompt)
    with pytest.raises(HandleError, match="another prompt"):
        handle.verified(key, [1, 2, 4])
    with pytest.raises(InvalidRequestError, match="not a KV handle"):
        KVHandle.from_json_object({"request_id": "r", "shards": "everything"})


def test_the_block_server_answers_only_its_deployment_and_only_what_it_holds():
    key = TransferKey.from_secret(b"rtrGEeVCilT80xVvHljgG6XfVkYKTOJP")
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

        assert ask(TransferKey.from_secret(b"clTPo4KBlyscmZ3elE61BDUjuyDUURb5")) is None   # no handshake, no answer
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
    key = TransferKey.from_secret(b"rtrGEeVCilT80xVvHljgG6XfVkYKTOJP")
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


def test_every_field_of_a_handle_is_signed_and_it_survives_json_but_not_its_expiry():
    prompt = [1, 2, 3]
    handle = a_handle(prompt)
    through_the_router = json.loads(json.dumps(handle.to_json_object()))   # as httpx and the router carry it
    assert KVHandle.from_json_object(through_the_router).verified(KEY, prompt) == handle
    better = msgspec.structs.replace(handle.first_logprob, logprob=-0.0001)
    for altered in (msgspec.structs.replace(handle, first_logprob=better),
                    msgspec.structs.replace(handle, first_logprob=None),
                    msgspec.structs.replace(handle, first_drafts=[7, 3, 6]),
                    msgspec.structs.replace(handle, nonce=KVHandle.new_nonce()),
                    msgspec.structs.replace(handle, expires_at=handle.expires_at + 3600)):
        with pytest.raises(HandleError, match="signature"):
            altered.verified(KEY, prompt)
    with pytest.raises(HandleError, match="expired"):
        a_handle(prompt, expires_in_s=-1).verified(KEY, prompt)


def test_a_handle_is_good_for_one_request_and_a_refusal_frees_the_prefill_copy_once():
    front = DecodeFront(KEY, 30.0, TransferStats("decode"))
    front.sender.close()
    front.sender = releases = RecordedReleases()
    prompt, params = [1, 2, 3], SamplingParams(max_tokens=8)
    handle = a_handle(prompt)
    assert front.verify(handle, prompt, params) is handle
    replay = KVHandle.from_json_object(json.loads(json.dumps(handle.to_json_object())))
    with pytest.raises(HandleError, match="already used"):
        front.verify(replay, prompt, params)
    assert not front.refuse(replay) and releases.sent == []       # a replayed copy frees nothing
    assert front.refuse(handle) and releases.sent == [("tcp://127.0.0.1:2", "r")]   # its own request was refused
    assert not front.refuse(handle) and len(releases.sent) == 1   # once
    unseen = a_handle(prompt)                     # refused before the front looked at it (a full queue)
    assert front.refuse(unseen) and len(releases.sent) == 2
    with pytest.raises(HandleError, match="already used"):
        front.claim(unseen)
    wrong_prompt, too_short = a_handle(prompt), a_handle(prompt)
    with pytest.raises(HandleError, match="another prompt"):
        front.verify(wrong_prompt, [1, 2, 4], params)
    with pytest.raises(InvalidRequestError, match="max_tokens=1"):
        front.verify(too_short, prompt, SamplingParams(max_tokens=1))
    assert len(releases.sent) == 4                # both freed at once, not at the prefill's timeout
    forged = a_handle(prompt, key=TransferKey.from_secret(b"clTPo4KBlyscmZ3elE61BDUjuyDUURb5"))
    assert not front.refuse(forged) and len(releases.sent) == 4   # never connects where a forgery says
    front.start("started", 0, {0}, started := front.claim(a_handle(prompt)))
    assert not front.refuse(started) and len(releases.sent) == 4  # in flight: its settle releases it


def test_used_nonces_are_remembered_until_their_handles_expire_and_never_beyond_the_cap():
    now = [1000.0]
    nonces = UsedNonces(capacity=2, clock=lambda: now[0])
    nonces.use("a", 1010.0)
    with pytest.raises(NonceRefused, match="already used"):
        nonces.use("a", 1010.0)
    nonces.use("b", 1020.0)
    with pytest.raises(NonceRefused, match="most"):
        nonces.use("c", 1020.0)                   # full of unexpired nonces: refused, nothing forgotten early
    now[0] = 1010.0                               # "a"'s handle expired (and is refused as expired anyway)
    assert "a" not in nonces and len(nonces) == 1
    nonces.use("c", 1020.0)


def test_an_import_refused_before_the_front_sees_it_is_refused_to_the_front():
    """A full queue (or a dead engine) refuses before `prepare`: the front still hears of the handle, so its
    prefill instance frees the parked KV at once."""
    class RecordingEngine(FakeEngine):
        def __init__(self):
            super().__init__(max_running=0)        # nothing starts: the queue stays full
            self.refused: list = []

        def refuse_import(self, handle) -> None:
            self.refused.append(handle)

    engine = RecordingEngine()
    handle = a_handle([1, 2, 3])

    async def scenario():
        async_engine = AsyncEngine(engine, AsyncEngineConfig(max_queue=1)).start()
        try:
            await async_engine.submit("first", [1, 2, 3], SamplingParams(max_tokens=4))
            with pytest.raises(QueueFullError):
                await async_engine.submit("second", [1, 2, 3], SamplingParams(max_tokens=4), import_kv=handle)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    asyncio.run(asyncio.wait_for(scenario(), 20))
    assert engine.refused == [handle]
