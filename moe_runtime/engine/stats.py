"""What the engine reports about itself: each DP worker's queue, KV cache and step times, the totals, health."""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.kv_tiers.connector import TierCounters


@dataclass
class WorkerStats:
    """One DP attention worker's queue and KV cache."""

    dp_rank: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    steps: int = 0                  # forward steps run (lock-step ones with empty batches included)
    step_seconds: float = 0.0       # wall time in forward steps, cumulative
    moe_comm_seconds: float = 0.0   # ... of which in dispatch + combine (expert-parallel communication)
    compute_seconds: float = 0.0    # ... of which running this rank's layers (pipeline: the rest is bubble)
    prefix_cache_queries: int = 0   # tokens looked up in the prefix cache at admissions (readmissions too), cumulative
    prefix_cache_hits: int = 0      # ... of which found cached (not computed again)
    loading: int = 0                # requests waiting for their prefix to come back from the KV tiers
    kv_tier_hit_tokens: int = 0     # ... prompt tokens admissions found in the KV tiers, cumulative
    kv_tier_failed_loads: int = 0   # admissions whose tier loads failed on some rank of the worker (recomputed)
    kv_tiers: list[TierCounters] = field(default_factory=list)   # each tier below the device pool, fastest first
    # With EngineConfig.debug_host_reads: decode steps counted, the host reads in them (forward + sampling, the
    # step's one result copy excluded), and those reads by "operation at file:line"
    spec_draft_tokens: int = 0      # speculative decoding: draft tokens verified, cumulative
    spec_accepted_tokens: int = 0   # ... of which accepted (each a token emitted without a forward of its own)
    spec_verify_steps: int = 0      # sequence-steps that verified drafts (acceptance length: 1 + accepted / these)
    captured_decode_steps: int = 0  # decode steps run as the compiled graph (--enable-torch-compile)
    captured_verify_steps: int = 0  # ... of which verified drafts (speculative decoding)
    carried_decode_steps: int = 0   # ... whose inputs the previous step's graph computed (no host preparation)
    decode_steps_counted: int = 0
    decode_host_reads: int = 0
    decode_host_read_sites: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / max(self.kv_blocks_total, 1)


@dataclass
class RecoveryStats:
    """Lost worker ranks and the restarts that resumed their requests (the front's `RankRecovery`)."""

    lost_ranks: int = 0            # ranks lost (a lost node counts its ranks; losses during a recovery count)
    recoveries: int = 0            # re-formations and restarts that brought the job back
    reformations: int = 0          # of which the ranks left re-formed (with replacements on one node), no restart
    returned_ranks: int = 0        # ranks lost across nodes that came back (their node restarted) and rejoined
    recovery_seconds: float = 0.0  # loss to every request sent again, cumulative
    resumed_requests: int = 0      # requests sent again with their tokens so far (recomputed), cumulative
    recovering: str | None = None  # the loss being recovered from, while the job restarts


@dataclass
class EngineStats:
    workers: list[WorkerStats] = field(default_factory=list)
    prompt_tokens: int = 0          # prompt tokens of admitted requests, since start
    generation_tokens: int = 0      # tokens generated, since start
    transfer: TransferStats | None = None   # KV transfers and queue times (the front's; None from a bare core)
    recovery: RecoveryStats | None = None   # lost ranks and restarts (None: this engine does not restart ranks)

    @property
    def running(self) -> int:
        return sum(w.running for w in self.workers)

    @property
    def waiting(self) -> int:
        return sum(w.waiting for w in self.workers)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(w.prefix_cache_queries for w in self.workers)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(w.prefix_cache_hits for w in self.workers)


@dataclass
class EngineHealth:
    healthy: bool
    detail: str = "ok"
    degraded: bool = False   # serving, but not all of itself (its ranks restart): requests are taken and wait
