"""What a GPU decode step needs of the step loop: the dispatch phase is the busy ranks' (so DeepEP's
low-latency mode is used whenever every busy rank decodes, also with idle DP workers)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from attention_dp.lockstep import LockstepLoop
from moe_runtime.engine.stats import WorkerStats
from multirank import ranks  # noqa: F401  (pytest fixture)


@dataclass
class Batch:
    is_prefill: bool


@dataclass
class PhaseExecutor:
    def needs_phase_agreement(self) -> bool:
        return True   # prefill and decode use different dispatch backends (DeepEP normal / low-latency)


@dataclass
class RecordingCore:
    """The parts of an `EngineCore` one lock-step step touches; records the phase it was run in."""

    batch: Batch | None
    executor: PhaseExecutor = field(default_factory=PhaseExecutor)
    phases: list[str] = field(default_factory=list)
    wake: object = None

    def schedule(self) -> Batch | None:
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


def _phase_of_one_step(batches: list[str | None]) -> str:
    """Rank r runs one step with `batches[r]` ("prefill", "decode" or None: idle); the phase it ran in."""
    rank = dist.get_rank()
    wanted = batches[rank]
    core = RecordingCore(None if wanted is None else Batch(is_prefill=wanted == "prefill"))
    group = dist.new_group(backend="gloo")
    LockstepLoop(core, Commands(), Results(), OneRankWorker(rank, group, dp_rank=rank))._step()
    return core.phases[0]


def test_an_idle_worker_follows_the_busy_ones_into_low_latency_decode(ranks):
    assert ranks(2).run(_phase_of_one_step, ["decode", None]) == ["decode", "decode"]
    assert ranks(2).run(_phase_of_one_step, [None, "decode"]) == ["decode", "decode"]


def test_any_prefill_makes_every_rank_take_the_prefill_mode(ranks):
    assert ranks(2).run(_phase_of_one_step, ["prefill", None]) == ["prefill", "prefill"]
    assert ranks(2).run(_phase_of_one_step, ["decode", "prefill"]) == ["prefill", "prefill"]
