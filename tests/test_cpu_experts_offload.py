"""--cpu-experts: routed experts in host memory, run by the CPU kernels on their own thread (moe/host_experts.py).

On this CPU-only machine the "device" is the CPU too, so the split runs with both sides here: its tokens against
transformers (one rank, and ep=2 with two DP attention workers, rebalancing and device-resident experts), its
logits against the same kernels run without the offload (bit for bit), the overlap itself (the routed experts
wait on a barrier that only the shared expert, running at the same time on the caller's thread, can pass), the
device-resident copies following the recorded load, and the refused combinations.
"""
import threading

import pytest
import torch

from engine_helpers import PROMPTS, greedy, runtime_prefill_logits
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.moe.device_resident_experts import hottest_slots
from moe_runtime.moe.host_experts import WORKER_THREAD
from moe_runtime.moe.layer import SparseMoE

ARCH = "qwen2_moe"   # routed experts, a gated shared expert: both sides of the split
TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(ARCH)


@pytest.fixture(scope="module")
def offloaded(checkpoint):
    """One rank; its two hottest experts per layer on the "device", re-chosen after every step."""
    with LLM(str(checkpoint), device="cpu", dtype="float32", cpu_experts=True, device_resident_experts=2,
             eplb_window=1) as llm:
        yield llm


def test_offloaded_experts_give_transformers_greedy_tokens(offloaded, greedy_oracle):
    outputs = offloaded.generate(PROMPTS, greedy(TOKENS))
    assert [out.token_ids for out in outputs] == greedy_oracle(ARCH, PROMPTS, TOKENS)


def test_offloaded_logits_equal_the_same_kernels_run_in_place(checkpoint):
    """Host-held experts through the worker thread compute what the cpu family computes in place, bit for bit."""
    logits = {}
    for name, options in {"in place": dict(kernels="cpu"), "offloaded": dict(cpu_experts=True)}.items():
        with LLM(str(checkpoint), device="cpu", dtype="float32", **options) as llm:
            logits[name] = runtime_prefill_logits(llm.core, PROMPTS[1])
    assert torch.equal(logits["offloaded"], logits["in place"])


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_offloaded_experts_give_the_in_place_tokens(checkpoint, quantization):
    """Weights kept quantized: the host kernels (int8 row scales, FP8 block scales decoded in registers) against the
    torch family's twins run in place."""
    tokens = {}
    for name, options in {"in place": dict(kernels="torch"), "offloaded": dict(cpu_experts=True)}.items():
        with LLM(str(checkpoint), device="cpu", dtype="float32", quantization=quantization, **options) as llm:
            tokens[name] = [out.token_ids for out in llm.generate(PROMPTS[:2], greedy(TOKENS))]
    assert tokens["offloaded"] == tokens["in place"]


def test_routed_experts_run_on_the_worker_while_the_shared_expert_runs(offloaded, monkeypatch):
    """Each side waits on a two-party barrier: it passes only when both run at once (a serial schedule breaks it
    after the timeout and the step fails), on two threads."""
    core = offloaded.core
    kernel = core.executor.host_kernel
    meeting = threading.Barrier(2, timeout=30)
    seen: list[tuple[str, str]] = []
    host_mlp = kernel.host_mlp

    def routed(x, counts, experts):
        meeting.wait()
        seen.append(("routed", threading.current_thread().name))
        return host_mlp(x, counts, experts)

    monkeypatch.setattr(kernel, "host_mlp", routed)
    blocks = [m for m in core.model.modules() if isinstance(m, SparseMoE)]
    for block in blocks:
        shared = getattr(block, block.shared_name)

        def meet_then_run(x, run=shared.forward):
            meeting.wait()
            seen.append(("shared", threading.current_thread().name))
            return run(x)

        monkeypatch.setattr(shared, "forward", meet_then_run)
    offloaded.generate(PROMPTS[:1], greedy(2))
    routed_threads = {name for side, name in seen if side == "routed"}
    shared_threads = {name for side, name in seen if side == "shared"}
    assert len(seen) == 2 * 2 * len(blocks)   # two steps (prefill, one decode), each layer both sides
    assert all(name.startswith(WORKER_THREAD) for name in routed_threads)
    assert shared_threads == {threading.current_thread().name}


def test_device_copies_follow_the_recorded_load(offloaded):
    """With a one-step window, the resident experts are each layer's two hottest of the last step."""
    offloaded.generate(PROMPTS[:2], greedy(3))
    executor = offloaded.core.executor
    load = executor.recorder.window_steps().sum(0)                                  # [L, E]
    for layer, resident in enumerate(executor.device_resident()):
        ids = executor.expert_store(layer).expert_ids
        assert resident == [ids[s] for s in hottest_slots(load[layer, ids], 2)]


def test_hottest_slots_prefer_load_then_the_lower_slot():
    assert hottest_slots(torch.tensor([3, 9, 0, 9, 5]), 3) == [1, 3, 4]
    assert hottest_slots(torch.tensor([0, 0, 0]), 2) == [0, 1]


@pytest.mark.parametrize("options,flag", [
    (dict(device_resident_experts=2), "--device-resident-experts 2 needs --cpu-experts"),
    (dict(cpu_experts=True, device_resident_experts=-1), "--device-resident-experts -1"),
    (dict(cpu_experts=True, enable_torch_compile=True), "--enable-torch-compile"),
    (dict(cpu_experts=True, quantization="mxfp4"), "--quantization mxfp4"),
    (dict(cpu_experts=True, ep=2, a2a_backend="deepep"), "--a2a-backend deepep"),
], ids=["resident-alone", "negative", "compile", "mxfp4", "deepep"])
def test_combinations_the_offload_cannot_run_are_refused(options, flag):
    with pytest.raises(EngineConfigError, match=flag):
        EngineConfig(model="unused", **options).validate_options()


def test_more_resident_experts_than_a_rank_holds_is_refused(checkpoint):
    with pytest.raises(EngineConfigError, match="--device-resident-experts 99"):
        LLM(str(checkpoint), device="cpu", dtype="float32", cpu_experts=True, device_resident_experts=99)


@pytest.mark.slow
def test_expert_parallel_offload_with_rebalancing_gives_transformers_greedy_tokens(checkpoint, greedy_oracle):
    """ep=2 over two DP attention workers: each rank's experts on its host, one hot copy per layer, and live
    rebalancing moving experts between the ranks' host stacks (the copies are retaken after each move)."""
    with LLM(str(checkpoint), device="cpu", dtype="float32", ep=2, dp_attn=2, num_redundant_experts=2,
             eplb_interval=4, eplb_window=2, cpu_experts=True, device_resident_experts=1) as llm:
        outputs = llm.generate(PROMPTS, greedy(TOKENS))
    assert [out.token_ids for out in outputs] == greedy_oracle(ARCH, PROMPTS, TOKENS)
