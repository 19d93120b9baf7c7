"""`cache_salt` (vLLM's field): tenants never share prefix-cache blocks.

- the hash chain: a salt roots it, so the same tokens under another salt (or none) hash apart at every
  block; the front's routing hashes are the ranks' (the same salted chain);
- the engine (tiny llama, prefix caching): a request under another salt reuses nothing of a cached
  prompt and computes the same tokens; the same salt reuses it;
- the server: the field is accepted on both endpoints and reaches the engine; a bad one is a 400 naming
  it; with several API keys each key's requests run under a salt of their own (never the key), with one
  key requests share a cache as before.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
from server_harness import FakeEngine

from engine_helpers import greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.kv_blocks.prefix_hash import ROOT_HASH, block_hashes, chain_root
from moe_runtime.records.sequence import Sequence
from moe_runtime.errors import InvalidRequestError
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.server import build_app
from test_server_unknown_fields import RecordingChatTokenizer

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
PROMPT = [(29 * i + 11) % 480 + 20 for i in range(41)]   # 10 full blocks and one token


def seq(request_id: str, cache_salt: str | None) -> Sequence:
    return Sequence(request_id, list(PROMPT), SamplingParams(max_tokens=4, cache_salt=cache_salt), arrival=0)


def shared_blocks(first_salt: str | None, second_salt: str | None) -> int:
    """Blocks the second request reuses of the first's (same tokens) in one block manager."""
    manager = BlockManager(64, BLOCK, enable_prefix_caching=True)
    first = seq("first", first_salt)
    assert manager.admit(first)
    manager.cache_full_blocks(first, len(PROMPT))
    second = seq("second", second_salt)
    assert manager.admit(second)
    return len(set(first.kv.block_table) & set(second.kv.block_table))


# ---- the hash chain and the block manager ------------------------------------------------------------------
def test_a_salt_roots_the_chain_so_every_block_hashes_apart():
    plain, salted, other = (block_hashes(PROMPT, BLOCK, salt) for salt in (None, "tenant-a", "tenant-b"))
    assert chain_root(None) == ROOT_HASH and plain == block_hashes(PROMPT, BLOCK)
    assert len(plain) == len(salted) == len(other) == 10
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert salted == block_hashes(PROMPT, BLOCK, "tenant-a")   # deterministic: one salt, one chain


def test_requests_share_blocks_only_under_the_same_salt():
    assert shared_blocks("tenant-a", "tenant-b") == 0
    assert shared_blocks(None, "tenant-a") == 0
    assert shared_blocks("tenant-a", None) == 0
    assert shared_blocks("tenant-a", "tenant-a") == 10
    assert shared_blocks(None, None) == 10


def test_a_salt_must_be_a_non_empty_bounded_string():
    for bad in ("", "x" * (SamplingParams.MAX_CACHE_SALT_CHARS + 1), 7):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            SamplingParams(cache_salt=bad).validate()
    SamplingParams(cache_salt="x" * SamplingParams.MAX_CACHE_SALT_CHARS).validate()


# ---- the engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cached(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("llama")), device="cpu", dtype="float32", block_size=BLOCK,
             enable_prefix_caching=True) as llm:
        yield llm


def hits_of(llm, salt: str | None) -> tuple[int, list[int]]:
    """Prefix-cache hit tokens of one request of PROMPT under `salt`, and its greedy tokens."""
    before = llm.engine.stats().prefix_cache_hits
    params = greedy(4)
    params.cache_salt = salt
    [output] = llm.generate([PROMPT], params)
    return llm.engine.stats().prefix_cache_hits - before, output.token_ids


def test_the_engine_shares_a_cached_prompt_only_under_the_same_salt(cached):
    first_hits, tokens = hits_of(cached, "tenant-a")
    other_hits, other_tokens = hits_of(cached, "tenant-b")     # another tenant sends the same prompt
    unsalted_hits, _ = hits_of(cached, None)
    again_hits, again_tokens = hits_of(cached, "tenant-a")     # the first tenant again
    assert (first_hits, other_hits, unsalted_hits) == (0, 0, 0)
    assert again_hits == 10 * BLOCK
    assert tokens == other_tokens == again_tokens


def test_the_front_routes_on_the_chain_the_ranks_cache(cached):
    """The cache-aware router's hashes (Front.prepare) are those the rank stored for the same salt."""
    hits_of(cached, "tenant-c")
    stored = set(cached.core.block_manager.prefix_cache._block_of)
    assert set(block_hashes(PROMPT, BLOCK, "tenant-c")) <= stored
    assert not set(block_hashes(PROMPT, BLOCK, "tenant-d")) & stored


# ---- the server ------------------------------------------------------------------------------------------
class RecordingEngine(FakeEngine):
    """Keeps the SamplingParams of every request it admitted."""

    def __init__(self):
        super().__init__()
        self.tokenizer = RecordingChatTokenizer()
        self.params: list[SamplingParams] = []

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.params.append(params)
        super().add_request(request_id, prompt_token_ids, params)


def post_all(requests: list[tuple[str, dict, str | None]], api_key=None) -> tuple[list[httpx.Response], list]:
    """Posts each (path, body, key) in turn to one app over a recording engine; the responses, the params."""
    engine = RecordingEngine()

    async def main():
        async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
        app = build_app(async_engine, "fake", api_key=api_key)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=20) as client:
                return [await client.post(path, json=body,
                                          headers={"Authorization": f"Bearer {key}"} if key else {})
                        for path, body, key in requests]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    responses = asyncio.run(asyncio.wait_for(main(), 30))
    return responses, engine.params


def completion(salt: str | None = None) -> dict:
    return {"prompt": [1, 2], "max_tokens": 2, **({"cache_salt": salt} if salt is not None else {})}


def chat(salt: str | None = None) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **({"cache_salt": salt} if salt is not None else {})}


def test_the_field_is_accepted_on_both_endpoints_and_reaches_the_engine():
    responses, params = post_all([("/v1/completions", completion("s1"), None),
                                  ("/v1/chat/completions", chat("s2"), None),
                                  ("/v1/completions", completion(), None)])
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    assert [p.cache_salt for p in params] == ["s1", "s2", None]


@pytest.mark.parametrize("salt", ["", "x" * (SamplingParams.MAX_CACHE_SALT_CHARS + 1), 5],
                         ids=["empty", "too_long", "not_a_string"])
def test_a_bad_salt_is_a_400_naming_the_field(salt):
    responses, params = post_all([("/v1/completions", completion(salt), None),
                                  ("/v1/chat/completions", chat(salt), None)])
    assert [r.status_code for r in responses] == [400, 400]
    assert all("cache_salt" in r.text for r in responses)
    assert params == []


def test_with_one_key_requests_share_a_cache_as_before():
    responses, params = post_all([("/v1/completions", completion(), "only"),
                                  ("/v1/completions", completion("mine"), "only")], api_key="only")
    assert [r.status_code for r in responses] == [200, 200]
    assert [p.cache_salt for p in params] == [None, "mine"]


def test_with_several_keys_each_key_gets_a_salt_of_its_own_never_the_key():
    keys = ["key-of-alice", "key-of-bob"]
    responses, params = post_all([
        ("/v1/completions", completion(), keys[0]),
        ("/v1/chat/completions", chat(), keys[0]),
        ("/v1/completions", completion(), keys[1]),
        ("/v1/completions", completion("shared"), keys[0]),
        ("/v1/completions", completion("shared"), keys[1]),   # bob names alice's salt: still apart
        ("/v1/completions", completion("shared"), keys[0]),
        ("/v1/completions", completion(), None),              # no key: refused
    ], api_key=keys)
    assert [r.status_code for r in responses] == [200] * 6 + [401]
    alice, alice_chat, bob, alice_shared, bob_shared, alice_shared_again = [p.cache_salt for p in params]
    assert alice is not None and alice == alice_chat                 # one key, one cache
    assert alice != bob and alice_shared != bob_shared               # two keys, two caches, whatever they send
    assert alice_shared == alice_shared_again != alice               # a key's own salts still split its cache
    assert not any(key in salt for key in keys for salt in (alice, bob, alice_shared, bob_shared))
