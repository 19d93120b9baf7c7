"""The multi-rank harness itself: results, errors with tracebacks, hangs, deaths, recovery."""

import os
import time

import pytest
import torch.distributed as dist

from multirank import MultiRankError, ranks  # noqa: F401  (ranks is a fixture)


def _rank_times(factor):
    return dist.get_rank() * factor, dist.get_world_size()


def _all_reduce_rank():
    import torch
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return float(value)


def _raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"deliberate failure on rank {bad_rank}")
    return "fine"


def _raise_while_others_wait(bad_rank):
    if dist.get_rank() == bad_rank:
        raise RuntimeError("deliberate failure before the barrier")
    dist.barrier()  # never completes: bad_rank does not join


def _die_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return "fine"


def _sleep(seconds):
    time.sleep(seconds)


def test_results_come_back_in_rank_order(ranks):
    assert ranks(2).run(_rank_times, 10) == [(0, 2), (10, 2)]
    assert ranks(2).run(_all_reduce_rank) == [1.0, 1.0]


def test_error_on_one_rank_shows_its_traceback_and_pool_survives(ranks):
    with pytest.raises(MultiRankError) as info:
        ranks(2).run(_raise_on_rank, 1)
    text = str(info.value)
    assert "failed on ranks [1]" in text
    assert "deliberate failure on rank 1" in text and "Traceback" in text
    assert ranks(2).run(_all_reduce_rank) == [1.0, 1.0]


def test_rank_stuck_in_collective_is_reported_not_waited_on(ranks):
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        ranks(2).run(_raise_while_others_wait, 0, timeout_s=60)
    assert time.monotonic() - start < 30, "waited on the stuck rank instead of the grace period"
    text = str(info.value)
    assert "deliberate failure before the barrier" in text
    assert "rank 1 did not answer" in text
    assert ranks(2).run(_all_reduce_rank) == [1.0, 1.0]  # restarted


def test_dead_rank_is_reported(ranks):
    with pytest.raises(MultiRankError, match=r"rank 1 died \(exit code 3\)"):
        ranks(2).run(_die_on_rank, 1)
    assert ranks(2).run(_rank_times, 1) == [(0, 2), (1, 2)]


def test_hung_call_times_out(ranks):
    with pytest.raises(MultiRankError, match="did not answer within 1.0s"):
        ranks(2).run(_sleep, 120, timeout_s=1.0)
    assert ranks(2).run(_rank_times, 1) == [(0, 2), (1, 2)]
