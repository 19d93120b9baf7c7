"""A rank of a P/D instance dies in the middle of KV transfers, and nothing is lost.

Both instances run `ep=2 dp_attn=2` (the decode instance with 2 redundant expert slots, the prefill instance with
none), so each re-forms with a fresh process in the lost rank's place (tests/test_rank_recovery.py holds the
colocated case). With DP attention on the decode side, the other worker steps with the importing one:
- a decode rank killed while imports are in flight: the decode instance resumes them from their first token (their
  prompts computed on its own ranks), every request ends with a colocated instance's tokens, and the prefill
  instance's parked copies are released, not left to their timeout;
- a prefill rank killed while it holds KV parked for the decode instance and a prompt not yet prefilled: the
  decode instance computes the prompts it can no longer pull, the prefill instance exports the resumed prompt
  again, and a transfer after the loss pulls KV as before (the replacement's block server is in the handles).
"""
from __future__ import annotations

import os
import signal

import pytest

from pd_helpers import free_blocks, greedy, prefill, run_all_until, run_until, wait_for_free
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_factory import make_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARCH = "mixtral"
PROMPTS = [[5, 17, 42, 99, 3], [(7 * i + 3) % 500 + 5 for i in range(40)], [(11 * i + 1) % 400 + 9 for i in range(23)],
           [31, 8, 77, 12, 64, 3, 250, 9]]
NEW_TOKENS = 8
TIMEOUT_S = 3.0   # an unpullable KV copy fails its pull (then its prompt runs on the decode side) after this


@pytest.fixture(scope="module")
def instances(tiny_checkpoint_factory, kv_key):
    """(prefill, decode, colocated): two 2-rank P/D instances and a one-rank colocated reference."""
    checkpoint = str(tiny_checkpoint_factory(ARCH))

    def engine(mode: str, **layout):
        return make_engine(EngineConfig(model=checkpoint, device="cpu", dtype="float32", kv_cache_memory=2 * 2**20,
                                        max_num_batched_tokens=16, disaggregation_mode=mode,
                                        kv_transfer_timeout_s=TIMEOUT_S, **layout))

    built = []
    try:
        for mode, layout in (("prefill", {"ep": 2, "dp_attn": 2}),   # no redundant slots: the replacement holds them
                             ("decode", {"ep": 2, "dp_attn": 2, "num_redundant_experts": 2}), ("none", {})):
            built.append(engine(mode, **layout))
        yield tuple(built)
    finally:
        for instance in built:
            instance.shutdown()


@pytest.fixture(scope="module")
def expected(instances):
    colocated = instances[2]
    for index, prompt in enumerate(PROMPTS):
        colocated.add_request(f"colocated-{index}", prompt, greedy(NEW_TOKENS))
    return [run_until([colocated], f"colocated-{index}").token_ids for index in range(len(PROMPTS))]


def kill(engine, rank: int) -> int:
    pid = engine.client.processes[rank].pid
    os.kill(pid, signal.SIGKILL)
    return pid


def recovered(engine, losses: int) -> bool:
    stats = engine.stats().recovery
    return stats.lost_ranks == losses and stats.recovering is None and engine.health().healthy


def test_a_decode_rank_lost_mid_transfer_its_imports_resume_from_their_first_token(instances, expected):
    p, d, _ = instances
    p_free = free_blocks(p)
    old_pids = {rank: process.pid for rank, process in d.client.processes.items()}
    handles = [prefill(p, f"dkill-p{i}", prompt).kv_handle for i, prompt in enumerate(PROMPTS)]
    recomputed = d.stats().transfer.recomputed
    for i, (prompt, handle) in enumerate(zip(PROMPTS, handles)):
        d.add_request(f"dkill-d{i}", prompt, greedy(NEW_TOKENS), import_kv=handle)
    kill(d, 1)                                          # before the decode front settled any import
    ids = [f"dkill-d{i}" for i in range(len(PROMPTS))]
    done = run_all_until([d, p], ids, timeout_s=120)
    assert [(done[i].token_ids, done[i].finish_reason, done[i].error) for i in ids] == \
        [(want, "length", None) for want in expected]
    stats = d.stats()
    assert (stats.recovery.lost_ranks, stats.recovery.reformations) == (1, 1), stats.recovery
    assert stats.transfer.recomputed > recomputed       # the imports in flight ran their prompts here
    new_pids = {rank: process.pid for rank, process in d.client.processes.items()}
    assert new_pids[0] == old_pids[0] and new_pids[1] != old_pids[1] and d.shape.dp_size == 2
    wait_for_free([(p, p_free)], timeout_s=TIMEOUT_S / 2)   # released by the decode front, not at the timeout
    transfers = d.stats().transfer.transfers
    first = prefill(p, "dkill-after-p", PROMPTS[1])     # the re-formed instance pulls KV as before
    d.add_request("dkill-after-d", PROMPTS[1], greedy(NEW_TOKENS), import_kv=first.kv_handle)
    assert run_until([d, p], "dkill-after-d").token_ids == expected[1]
    assert d.stats().transfer.transfers == transfers + 1


def test_a_prefill_rank_lost_with_kv_parked_the_decode_side_computes_what_it_cannot_pull(instances, expected):
    p, d, _ = instances
    losses = p.stats().recovery.lost_ranks
    parked = [prefill(p, f"pkill-p{i}", prompt) for i, prompt in enumerate(PROMPTS[:2])]
    holder = next(rank for rank, shard in p.shape.kv_shards.items()
                  if shard.endpoint == parked[0].kv_handle.shards[0].endpoint)
    p.add_request("pkill-waiting", PROMPTS[2], greedy(1), export_kv=True)   # not prefilled yet: resumed, exported
    kill(p, holder)                                     # the rank holding the first prompt's KV
    recomputed = d.stats().transfer.recomputed
    for i, output in enumerate(parked):
        d.add_request(f"pkill-d{i}", PROMPTS[i], greedy(NEW_TOKENS), import_kv=output.kv_handle)
    done = run_all_until([d, p], ["pkill-d0", "pkill-d1", "pkill-waiting"], timeout_s=120)
    assert [done[f"pkill-d{i}"].token_ids for i in range(2)] == expected[:2]
    assert d.stats().transfer.recomputed > recomputed   # at least the KV parked on the killed rank
    assert recovered(p, losses + 1) and p.stats().recovery.reformations >= 1
    waiting = done["pkill-waiting"]
    assert waiting.token_ids == expected[2][:1] and waiting.kv_handle is not None
    transfers = d.stats().transfer.transfers
    d.add_request("pkill-after-d", PROMPTS[2], greedy(NEW_TOKENS), import_kv=waiting.kv_handle)
    assert run_until([d, p], "pkill-after-d").token_ids == expected[2]
    assert d.stats().transfer.transfers == transfers + 1   # pulled from the re-formed instance, not recomputed
