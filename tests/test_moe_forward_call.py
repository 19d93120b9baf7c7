"""One MoE forward call: `MoEExecutor.run` serves eager and captured steps alike.

- An eager step calls the phase's `ModularMoE` plainly: no generator is entered (the staged form is two-batch
  overlap's only), and the shared experts are added to the routed output.
- A captured step on one rank (torch.compile, fullgraph) goes through the same `run`, whose captured core is the
  pair kernel (`PairMoE`); the grouped `ModularMoE` is never traced, and the output is the eager one.
"""
from __future__ import annotations

import pytest
import torch

from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.load_balancer import Placement
from moe_runtime.moe.modular_moe import ModularMoE
from moe_runtime.moe.pair_moe import PairMoE
from test_moe_seam_contract import NUM_EXPERTS, build_executor, logical_reference, move_to, routed_tokens


def _refuse(*args, **kwargs):
    raise AssertionError("this path must not run here")


def test_an_eager_step_calls_the_modular_moe_plainly_and_adds_the_alongside_output(monkeypatch):
    executor, _ = build_executor(ParallelContext.single("cpu"), "local", redundant=0)
    monkeypatch.setattr(ModularMoE, "stages", _refuse)
    monkeypatch.setattr(PairMoE, "__call__", _refuse)
    executor.begin_step("decode")
    x, topk = routed_tokens(seed=5, num_tokens=6)
    shared = torch.full_like(x, 0.25)                                              # [T, H]
    torch.testing.assert_close(executor.run(0, x, topk).double(), logical_reference(x, topk), rtol=0, atol=1e-5)
    torch.testing.assert_close(executor.run(0, x, topk, alongside=lambda: shared).double(),
                               logical_reference(x, topk) + 0.25, rtol=0, atol=1e-5)


@pytest.mark.parametrize("moved", [False, True])
def test_a_captured_step_on_one_rank_runs_the_same_call_through_the_pair_kernel(monkeypatch, moved):
    executor, experts = build_executor(ParallelContext.single("cpu"), "local", redundant=0)
    if moved:   # slots no longer the identity: the replica choice maps logical ids to other slots
        swapped = Placement.from_phy2log(torch.tensor([[1, 0, 2, 3, 5, 4]]), NUM_EXPERTS, num_ranks=1)
        move_to(swapped, experts, rank=0)
        executor.set_placement(swapped)
    executor.begin_step("decode")
    x, topk = routed_tokens(seed=11, num_tokens=4)
    eager = executor.run(0, x, topk)
    monkeypatch.setattr(ModularMoE, "__call__", _refuse)   # a grouped core in the trace would fail it
    torch._dynamo.reset()
    captured = torch.compile(executor.run, fullgraph=True, backend="eager")(0, x, topk)
    torch._dynamo.reset()
    torch.testing.assert_close(captured, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(captured.double(), logical_reference(x, topk), rtol=0, atol=1e-5)
