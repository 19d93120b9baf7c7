"""Messages between the front process and the worker ranks (picklable dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine types travel in these messages; this package does not depend on the engine
    from moe_runtime.engine_protocol import WorkerStats
    from moe_runtime.outputs import RequestOutput
    from moe_runtime.sampling_params import SamplingParams


# front -> every worker (broadcast; applied by all ranks at the same lock-step boundary)
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dp_rank: int


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class SnapshotExpertLoad:
    """Every rank sums its expert-load counts with the others; rank 0 reports."""


@dataclass
class RebalanceNow:
    """Plan and migrate now. `fail_on_rank` injects a migration failure there (fault-injection tests)."""

    fail_on_rank: int | None = None


@dataclass
class Shutdown:
    pass


# worker -> front
@dataclass
class WorkerReady:
    rank: int
    dp_rank: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    expert_bytes: int          # bytes of routed-expert weights resident on this rank
    total_expert_bytes: int    # bytes of routed-expert weights in the whole model
    weight_bytes: int = 0      # bytes of all weights resident on this rank
    pp_rank: int = 0


@dataclass
class StepOutputs:
    rank: int
    dp_rank: int
    outputs: list[RequestOutput]
    stats: WorkerStats


@dataclass
class ExpertLoadReport:
    snapshot: object            # load_balancer.ExpertLoadSnapshot of one pipeline stage, summed over its ranks
    stage: int = 0


@dataclass
class RebalanceReport:
    outcome: object             # load_balancer.live_rebalancer.RebalanceOutcome
    index: int                  # rebalances run so far, this one excluded


@dataclass
class WorkerFailed:
    rank: int
    error: str
    traceback: str = field(default="", repr=False)
