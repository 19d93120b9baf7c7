"""What a GPU decode step needs, held on CPU (issue: the GPU-fit decode path):

1. the dispatch phase is the busy ranks' (so DeepEP's low-latency mode is used whenever every busy rank
   decodes, also with idle DP workers);
2. DeepEP's preconditions (bf16 rows, its low-latency hidden sizes) are checked where the backend is chosen,
   and the emulation holds its callers to them;
3. a decode step of `LLM(ep=2, dp_attn=2)` through the emulated low-latency dispatcher reads nothing from
   the device before its result, and one MoE layer with that dispatcher compiles whole;
4. one DeepEP buffer per rank serves both modes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

import moe_runtime.dispatch.factory
from moe_runtime.attention_dp.lockstep import LockstepLoop
from deepep_emulation import DeepEPRuleBroken, EmulatedDeepEPBuffer
from moe_runtime.dispatch import DispatchConfig, make_dispatcher
from moe_runtime.dispatch.factory import BackendChoice, choose_backend, make_phase_dispatchers
from moe_runtime.kernels import TopK, get_kernels
from moe_runtime.load_balancer import SlotGeometry
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.engine.scheduler import ScheduledBatch
from moe_runtime.records.sequence import Sequence
from moe_runtime.engine.stats import WorkerStats
from moe_runtime.sampling.host_reads import HostReadCounter, opaque_device_kernel
from moe_runtime.front.llm import LLM
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.sampling.params import SamplingParams
from multirank import ranks  # noqa: F401  (pytest fixture)


class NoGroupBuffer(EmulatedDeepEPBuffer):
    """Constructible without a process group: enough to build and ask a dispatcher."""

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, **kwargs):
        self.group, self.rank, self.group_size = group, 0, 2
        self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode = num_nvl_bytes, num_rdma_bytes, low_latency_mode


@dataclass
class PhaseExecutor:
    def needs_phase_agreement(self) -> bool:
        return True   # prefill and decode use different dispatch backends (DeepEP normal / low-latency)


@dataclass
class RecordingCore:
    """The parts of an `EngineCore` one lock-step step touches; records the phase it was run in."""

    batch: ScheduledBatch | None
    executor: PhaseExecutor = field(default_factory=PhaseExecutor)
    phases: list[str] = field(default_factory=list)
    wake: object = None

    def schedule(self) -> ScheduledBatch | None:
        return self.batch

    def execute(self, batch, phase: str) -> list:
        self.phases.append(phase)
        return []

    def take_prefix_cache_events(self):
        return None

    def worker_stats(self) -> WorkerStats:
        return WorkerStats(0, 0, 0, 1, 1, 0)


@dataclass
class OneRankWorker:
    """A rank that is its own DP worker (dp_attn = world size), on the world's gloo group."""

    rank: int
    world_control_group: object
    dp_rank: int = 0
    ep_rank: int = 0
    pp_rank: int = 0
    is_worker_leader: bool = True
    is_last_stage: bool = True
    ep_group: object = None


class Commands:
    def wake(self) -> None:
        pass


class Results(list):
    def put(self, message) -> None:
        self.append(message)


def _one_sequence_batch(kind: str) -> ScheduledBatch:
    """A step of one sequence: "prefill" computes its prompt, "decode" its last token, "verify" that and 2 drafts."""
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0), arrival=0)
    if kind == "prefill":
        seq.num_scheduled_tokens = 3
        return ScheduledBatch([seq])
    seq.output_token_ids, seq.num_cached_tokens = [4], 3
    seq.drafts.token_ids = [5, 6] if kind == "verify" else []
    seq.num_scheduled_tokens = seq.logit_rows
    return ScheduledBatch([seq])


def _phase_of_one_step(batches: list[str | None]) -> str:
    """Rank r runs one step with `batches[r]` ("prefill", "decode", "verify" or None: idle); the phase it ran in."""
    rank = dist.get_rank()
    wanted = batches[rank]
    core = RecordingCore(None if wanted is None else _one_sequence_batch(wanted))
    group = dist.new_group(backend="gloo")
    LockstepLoop(core, Commands(), Results(), OneRankWorker(rank, group, dp_rank=rank))._step()
    return core.phases[0]


def test_an_idle_worker_follows_the_busy_ones_into_low_latency_decode(ranks):
    assert ranks(2).run(_phase_of_one_step, ["decode", None]) == ["decode", "decode"]
    assert ranks(2).run(_phase_of_one_step, [None, "decode"]) == ["decode", "decode"]


def test_any_prefill_makes_every_rank_take_the_prefill_mode(ranks):
    assert ranks(2).run(_phase_of_one_step, ["prefill", None]) == ["prefill", "prefill"]
    assert ranks(2).run(_phase_of_one_step, ["decode", "prefill"]) == ["prefill", "prefill"]
    assert ranks(2).run(_phase_of_one_step, ["verify", "prefill"]) == ["prefill", "prefill"]


def test_a_worker_verifying_drafts_decodes_beside_plain_decodes_and_idle_workers(ranks):
    """A verify step's rows fit the decode bound (drafts counted): every rank stays in the low-latency mode."""
    assert ranks(2).run(_phase_of_one_step, ["verify", "decode"]) == ["decode", "decode"]
    assert ranks(2).run(_phase_of_one_step, [None, "verify"]) == ["decode", "decode"]


# ------------------------------------------------------------------ item 2: DeepEP's preconditions
DEEPEP_HIDDEN = 2048        # one of the hidden sizes DeepEP's low-latency kernels are built for


def _deepep_present(monkeypatch) -> None:
    monkeypatch.setattr(moe_runtime.dispatch.factory, "deep_ep_importable", lambda module: True)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_auto_falls_back_to_all_to_all_for_rows_deepep_cannot_move(monkeypatch, phase):
    _deepep_present(monkeypatch)
    float32 = choose_backend("auto", "cuda", 8, phase, dtype=torch.float32, hidden_size=DEEPEP_HIDDEN)
    assert float32.backend == "all_to_all" and "bfloat16" in float32.note and "float32" in float32.note
    demo_sized = choose_backend("auto", "cuda", 8, phase, dtype=torch.bfloat16, hidden_size=256)
    expected = "all_to_all" if phase == "decode" else "deepep_normal"   # low latency: a fixed list of sizes
    assert demo_sized.backend == expected
    if phase == "decode":
        assert "256" in demo_sized.note and "2048" in demo_sized.note
    fits = choose_backend("auto", "cuda", 8, phase, dtype=torch.bfloat16, hidden_size=DEEPEP_HIDDEN)
    assert fits == BackendChoice("deepep_low_latency" if phase == "decode" else "deepep_normal")


def test_the_fallback_is_said_in_one_log_line(monkeypatch, caplog):
    _deepep_present(monkeypatch)
    config = DispatchConfig("auto", SlotGeometry(4, 2), 0, None, 256, dtype=torch.float32, device="cuda",
                            max_tokens_per_rank=8, deepep_buffer_cls=NoGroupBuffer)
    with caplog.at_level(logging.INFO, logger="moe_runtime.dispatch.factory"):
        dispatchers = make_phase_dispatchers(config)
    assert {d.__class__.__name__ for d in dispatchers.values()} == {"AllToAllDispatcher"}
    said = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(said) == 1 and "float32" in said[0], said


def test_an_explicit_deepep_that_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="'deepep' cannot run: DeepEP moves bfloat16 rows only.*float32"):
        choose_backend("deepep", "cuda", 8, "prefill", dtype=torch.float32, hidden_size=DEEPEP_HIDDEN)
    with pytest.raises(ValueError, match="'deepep_low_latency' cannot run: .*hidden sizes.*the model's is 256"):
        choose_backend("deepep_low_latency", "cuda", 8, "decode", dtype=torch.bfloat16, hidden_size=256)
    # 'deepep' of a hidden size only the normal kernels take: decode runs in the normal mode, and says so
    choice = choose_backend("deepep", "cuda", 8, "decode", dtype=torch.bfloat16, hidden_size=256)
    assert choice.backend == "deepep_normal" and "256" in choice.note
    with pytest.raises(ValueError, match="float32"):     # the dispatcher itself refuses too
        make_dispatcher(DispatchConfig("deepep_normal", SlotGeometry(4, 2), 0, None, DEEPEP_HIDDEN,
                                       dtype=torch.float32, deepep_buffer_cls=NoGroupBuffer))


def _emulation_refuses(rows: torch.Tensor, mode: str) -> str:
    group = dist.new_group(backend="gloo")
    buffer = EmulatedDeepEPBuffer(group, 1 << 20, 1 << 20, low_latency_mode=True)
    slots = torch.zeros(rows.shape[0], 1, dtype=torch.int64)
    try:
        if mode == "normal":
            layout = buffer.get_dispatch_layout(slots, 2)
            buffer.dispatch(rows, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                            num_tokens_per_expert=layout[2], topk_idx=slots, topk_weights=torch.ones(slots.shape))
        else:
            buffer.low_latency_dispatch(rows, slots, 4, 2, use_fp8=False)
    except DeepEPRuleBroken as refused:
        return str(refused)
    return "accepted"


def test_the_emulation_holds_its_callers_to_deepeps_rules(ranks):
    assert "bfloat16" in ranks(2).run(_emulation_refuses, torch.zeros(2, DEEPEP_HIDDEN), "normal")[0]
    assert "hidden sizes" in ranks(2).run(_emulation_refuses, torch.zeros(2, 256, dtype=torch.bfloat16),
                                          "low_latency")[0]
    assert ranks(2).run(_emulation_refuses, torch.zeros(2, DEEPEP_HIDDEN, dtype=torch.bfloat16),
                        "low_latency") == ["accepted", "accepted"]


# ------------------------------------------------------------------ item 4: one DeepEP buffer per rank
def _both_modes_on_one_buffer() -> dict:
    rank = dist.get_rank()
    before = EmulatedDeepEPBuffer.instances
    config = DispatchConfig("deepep", SlotGeometry(4, 2), rank, None, DEEPEP_HIDDEN, max_tokens_per_rank=4,
                            deepep_buffer_cls=EmulatedDeepEPBuffer)
    dispatchers = make_phase_dispatchers(config)
    made = EmulatedDeepEPBuffer.instances - before
    x = torch.randn(3, DEEPEP_HIDDEN).to(torch.bfloat16)
    slots, weights = torch.tensor([[0, 3], [1, 2], [2, -1]]), torch.rand(3, 2)
    outputs = {}
    for phase in ("prefill", "decode", "decode", "prefill", "decode"):      # normal traffic dirties the memory
        dispatcher = dispatchers[phase]
        dispatcher.begin_step()
        out = dispatcher.dispatch(x, slots, weights)
        outputs.setdefault(phase, []).append(dispatcher.combine(out.recv_x, out.handle).float())
    same_buffer = dispatchers["prefill"].buffer is dispatchers["decode"].buffer
    unclean = "none"
    dispatchers["prefill"].dispatch(x, slots, weights)             # normal traffic, then low latency without
    try:                                                           # the step boundary that cleans: refused
        dispatchers["decode"].buffer.low_latency_dispatch(x, slots, 4, 4, use_fp8=False)
    except DeepEPRuleBroken as refused:
        unclean = str(refused)
    expected = torch.where(slots >= 0, weights, 0.0).sum(dim=1, keepdim=True) * x.float()   # identity experts
    return {"made": made, "same_buffer": same_buffer, "unclean": unclean,
            "low_latency_mode": dispatchers["decode"].buffer.low_latency_mode,
            "errors": [float((y - expected).abs().max()) for ys in outputs.values() for y in ys]}


def test_one_deepep_buffer_serves_both_modes(ranks):
    for result in ranks(2).run(_both_modes_on_one_buffer):
        assert result["made"] == 1 and result["same_buffer"] and result["low_latency_mode"], result
        assert max(result["errors"]) < 5e-2, result
        assert "clean_low_latency_buffer" in result["unclean"], result


# ------------------------------------------------------------------ item 3: no host read in a decode step
def test_the_counter_sees_every_kind_of_host_read_and_nothing_inside_a_device_kernel():
    values = torch.arange(6)
    with torch.inference_mode(), HostReadCounter() as counter:   # the engine's steps run in inference mode
        int(values.max()), values.sum().item(), bool((values > 1).any()), values.tolist()
        values[values > 2], torch.nonzero(values), torch.bincount(values), torch.repeat_interleave(values, values)
        values.cumsum(0), values.sort(), torch.where(values > 2, values, 0)        # device-side: not reads
        with opaque_device_kernel():
            values.tolist()
    assert counter.counts == {"__int__": 1, "item": 1, "__bool__": 1, "tolist": 1, "index": 1, "nonzero": 1,
                              "bincount": 1, "repeat_interleave": 1}, counter.counts
    assert all("test_capture_safe.py" in site for site in counter.sites), counter.sites


@pytest.fixture(scope="module")
def deepseek_2048(tiny_checkpoint_factory):
    """A DeepSeek-V3 model (MLA, a dense first layer, shared and routed experts) of a hidden size DeepEP's
    low-latency kernels take."""
    return tiny_checkpoint_factory("deepseek_v3", hidden_size=DEEPEP_HIDDEN)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18]]


def _generate(path, backend: str, **extra):
    with LLM(str(path), device="cpu", dtype="bfloat16", ep=2, dp_attn=2, a2a_backend=backend,
             deepep_module="deepep_emulation", max_num_seqs=8, **extra) as llm:
        busy = [out.token_ids for out in llm.generate(PROMPTS, [
            SamplingParams(max_tokens=5, temperature=0), SamplingParams(max_tokens=5, temperature=0.8, seed=3),
            SamplingParams(max_tokens=5, top_p=0.9, top_k=20, seed=4, logprobs=2)])]
        one_idle = [out.token_ids for out in llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0))]
        return busy, one_idle, llm.engine.stats().workers


def test_decode_steps_through_deepep_low_latency_read_nothing_from_the_device(deepseek_2048):
    busy, one_idle, workers = _generate(deepseek_2048, "deepep", debug_host_reads=True)
    for worker in workers:
        assert worker.decode_steps_counted >= 4, worker
        assert worker.decode_host_reads == 0, worker.decode_host_read_sites
    # the low-latency path gives the greedy tokens all_to_all gives (both bf16, the same layout; a sampled row may
    # draw otherwise: bf16 sums in another order move its probabilities, and so the race between them)
    other_busy, other_idle, _ = _generate(deepseek_2048, "all_to_all")
    assert (busy[0], one_idle) == (other_busy[0], other_idle)
    assert [len(tokens) for tokens in busy] == [5, 5, 5]


def _moe_layer_compiled_whole() -> dict:
    """One MoE layer's executor run (router ids -> replicas -> DeepEP low-latency dispatch -> masked experts ->
    combine) under torch.compile(fullgraph=True): any graph break fails the compile."""
    rank = dist.get_rank()
    num_experts, intermediate = 4, 8
    parallel = ParallelContext(world_size=2, rank=rank, ep_size=2, ep_rank=rank)
    executor = MoEExecutor(get_kernels("cpu", "torch"), parallel, backend="deepep", num_redundant_experts=0,
                           hidden_size=DEEPEP_HIDDEN, dtype=torch.bfloat16, record_load=True, decode_max_tokens=4,
                           deepep_module="deepep_emulation")
    experts = ExpertWeights(executor.local_expert_ids(num_experts), DEEPEP_HIDDEN, intermediate, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) * 0.02)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.3)
    executor.register_layer(experts, num_experts)
    executor.finish_registration()
    x = torch.randn(3 + rank, DEEPEP_HIDDEN, generator=gen).to(torch.bfloat16)
    topk = TopK(torch.rand(3 + rank, 2, generator=gen), torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1]][:3 + rank]))
    executor.begin_step("decode")
    eager = executor.run(0, x, topk)
    torch._dynamo.reset()
    compiled = torch.compile(executor.run, fullgraph=True, backend="aot_eager")
    executor.begin_step("decode")
    captured = compiled(0, x, topk)
    recorded = executor.recorder._expert_step[0].tolist()
    return {"layout": executor._by_phase["decode"].dispatcher.layout(), "recorded": recorded,
            "error": float((captured.float() - eager.float()).abs().max()), "scale": float(eager.float().abs().max())}


def test_one_moe_layer_with_the_low_latency_dispatcher_compiles_whole(ranks):
    for result in ranks(2).run(_moe_layer_compiled_whole):
        assert result["layout"] == "masked", result
        assert result["error"] <= 1e-2 * max(result["scale"], 1.0), result
        assert sum(result["recorded"]) > 0, result          # the expert load is recorded in a captured step too


# ------------------------------------------------------------------ the EP decode step captured whole
def test_the_ep_decode_step_is_captured_whole_and_gives_the_eager_tokens(deepseek_2048):
    """LLM(ep=2, dp_attn=2) with --enable-torch-compile: every rank's decode step is one graph with DeepEP's
    low-latency dispatch and combine inside (aot_eager here: the trace is the capture's; CUDA replays it)."""
    tokens, captured = {}, {}
    for compiled in (False, True):
        with LLM(str(deepseek_2048), device="cpu", dtype="bfloat16", ep=2, dp_attn=2, a2a_backend="deepep",
                 deepep_module="deepep_emulation", max_num_seqs=8, enable_torch_compile=compiled,
                 torch_compile_backend="aot_eager") as llm:
            params = SamplingParams(max_tokens=5, temperature=0)
            tokens[compiled] = [out.token_ids for out in llm.generate(PROMPTS, params)]
            tokens[compiled] += [out.token_ids for out in llm.generate(PROMPTS[:1], params)]   # one worker idle
            captured[compiled] = [worker.captured_decode_steps for worker in llm.engine.stats().workers]
    assert tokens[True] == tokens[False]
    assert captured[False] == [0, 0] and min(captured[True]) >= 4, captured   # every rank's decode steps


def test_a_captured_ep_step_needs_deepeps_low_latency_kernels():
    with pytest.raises(EngineConfigError, match="--a2a-backend deepep --dp-attn 2"):
        EngineConfig(model="unused", ep=2, dp_attn=2, enable_torch_compile=True).validate_options()
    with pytest.raises(EngineConfigError, match="--dp-attn 4"):
        EngineConfig(model="unused", ep=4, dp_attn=2, a2a_backend="deepep", enable_torch_compile=True).validate_options()
    EngineConfig(model="unused", ep=2, dp_attn=2, a2a_backend="deepep", enable_torch_compile=True).validate_options()
