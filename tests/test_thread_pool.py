"""One intra-op pool per rank (kernels/thread_pool.py): its size and cores decided from the process's affinity,
applied once, and the compiled expert kernel running in torch's pool rather than threads of its own."""
import os

import pytest
import torch

from moe_runtime.kernels.cpu_native.build import native_experts
from moe_runtime.kernels.cpu_native.expert_kernel import cpu_expert_mlp
from moe_runtime.kernels.thread_pool import ThreadPlan, available_cores


def test_a_rank_alone_takes_every_core_it_may_use_unpinned():
    plan = ThreadPlan.for_rank(cores=[2, 3, 5])
    assert plan == ThreadPlan((2, 3, 5), 3, pin=False)
    assert ThreadPlan.for_rank().threads == len(available_cores())
    if hasattr(os, "sched_getaffinity"):
        assert set(available_cores()) == os.sched_getaffinity(0)


def test_ranks_on_one_host_split_the_cores_and_are_pinned_to_their_share():
    cores = list(range(8, 16))
    plans = [ThreadPlan.for_rank(rank, 3, cores) for rank in range(3)]
    assert [plan.cores for plan in plans] == [(8, 9), (10, 11), (12, 13)]   # 8 // 3 each: no core shared
    assert all(plan.pin and plan.threads == 2 for plan in plans)


def test_more_ranks_than_cores_get_one_thread_each_on_shared_cores():
    plan = ThreadPlan.for_rank(3, 4, [0, 1])
    assert plan == ThreadPlan((0, 1), 1, pin=False)


def test_the_pool_is_sized_once_and_a_second_apply_changes_nothing():
    before = torch.get_num_threads()
    try:
        plan = ThreadPlan(tuple(available_cores()), 1)
        plan.apply()
        assert torch.get_num_threads() == 1
        assert plan.apply() is False
    finally:
        torch.set_num_threads(before)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_the_compiled_expert_kernel_runs_in_torchs_pool_not_threads_of_its_own():
    assert native_experts() is not None, "the compiled CPU kernels need a C++ compiler (g++), as CI installs"
    before = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 96, 64, generator=generator), torch.randn(4, 64, 48, generator=generator)
    x, counts = torch.randn(12, 64, generator=generator), torch.tensor([5, 0, 4, 3])
    try:
        for size in (1, 2):
            torch.set_num_threads(size)
            torch.randn(512, 512) @ torch.randn(512, 512)        # torch's pool at this size, started
            started = _threads()
            out = cpu_expert_mlp(x, counts, w13, w2)
            assert _threads() == started, f"the kernel started threads of its own at {size} intra-op threads"
            assert torch.isfinite(out).all()
    finally:
        torch.set_num_threads(before)
