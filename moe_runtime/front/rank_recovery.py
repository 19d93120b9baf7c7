"""A lost worker rank without a lost request: the job's ranks start again and every request resumes from its tokens.

The front holds what a request is: its prompt, its sampling parameters (with the seed the front gave it, so the
ranks of a worker draw alike) and every token the ranks sent for it. When a rank dies (its process exits, its
connection closes, or a rank's collective fails because a peer died), the ranks that are left are stopped (a
torch.distributed group cannot lose a member), a new job with the same layout starts, and each request still
running is sent again with its tokens so far (`AddRequest.resumed_token_ids`): its worker recomputes them as it
would after a preemption and goes on. Seeded draws depend on (seed, position) only, so a sampled request goes on
with the tokens it would have had; greedy ones are unchanged. Streams stay open: the front never ended them.

Requests that arrive meanwhile wait in the front and start with the others; an abort meanwhile just forgets the
request. An expert-load snapshot or a rebalance in flight fails (the new job starts from the checkpoint's
placement). Restarts are bounded (`max_restarts` in `WINDOW_S`): a crash that comes back at once ends the engine
with the reason, as one without recovery does. Only jobs whose ranks this front started on one node restart; the
others re-form where their layout allows, or end as before (`can_restart`). A P/D instance recovers alike: a
prefill instance forgets what its lost job had parked (the decode instances pulling it compute those prompts
themselves) and exports its resumed requests again; a decode instance resumes its imports in flight from their
first token, their prompts computed on its own ranks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from moe_runtime.attention_dp.messages import AddRequest
from moe_runtime.attention_dp.router import DPRouter
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.stats import RecoveryStats
from moe_runtime.errors import EngineDeadError
from moe_runtime.front.core_client import EngineCoreClient
from moe_runtime.front.output_processor import RequestState
from moe_runtime.front.rank_reform import RanksLostMeanwhile, ReformFailed

logger = logging.getLogger(__name__)

WINDOW_S = 600.0   # restarts counted over this long


@dataclass
class RankRecovery:
    max_restarts: int
    relaunch: Callable[[], EngineCoreClient] | None   # a new job with the same layout (blocks until its ranks are
                                                      # ready); None: ranks this front did not start (re-form only)
    full_world_size: int = 1                   # the ranks the job started with
    stats: RecoveryStats = field(default_factory=RecoveryStats)
    _restarts: list[float] = field(default_factory=list)
    _began: float = 0.0
    _impossible: bool = False   # the ranks left cannot re-form and none can restart: a retry would fail alike

    @classmethod
    def for_front(cls, config: EngineConfig, client: EngineCoreClient,
                  relaunch: Callable[[], EngineCoreClient] | None) -> "RankRecovery | None":
        """A front's recovery where its client's ranks can re-form or it can restart them (None: a loss ends it)."""
        if relaunch is None and not client.reformable:
            return None
        return cls(config.max_rank_restarts, relaunch, client.shape.world_size)

    @staticmethod
    def can_restart(config: EngineConfig) -> bool:
        """Whether this front can start the job again by itself: every rank its own child on this node."""
        return config.max_rank_restarts > 0 and config.nnodes == 1 and config.launch_workers

    @property
    def recovering(self) -> bool:
        return self.stats.recovering is not None

    def begin(self, reason: str) -> bool:
        """A rank was lost: whether to restart (False: restarts used up, the engine ends). The loss counts one
        rank here; a re-formation that finds more (a node's ranks, or ranks lost meanwhile) counts the rest."""
        now = time.monotonic()
        self.stats.lost_ranks += 1
        self._restarts = [t for t in self._restarts if now - t < WINDOW_S]
        if self._impossible:
            return False
        if len(self._restarts) >= self.max_restarts:
            logger.error("%s; %d restarts in the last %.0f s already: not restarting again", reason,
                         len(self._restarts), WINDOW_S)
            return False
        self._restarts.append(now)
        self._began = now
        self.stats.recovering = reason
        logger.warning("%s; restarting the job's ranks and resuming its requests", reason)
        return True

    def restart(self, old: EngineCoreClient) -> EngineCoreClient:
        """The surviving ranks re-form without the lost ones where the layout allows (`RankClient.reform`: they
        keep their weights); else, or when that fails, the old job's ranks stop and a new job starts (blocking:
        run it off the event loop)."""
        if old.reformable:
            try:
                outcome = old.reform()
                self.stats.reformations += 1
                if outcome.returned:   # not a loss: lost ranks came back
                    self.stats.lost_ranks -= 1
                    self.stats.returned_ranks += outcome.returned
                self.stats.lost_ranks += max(outcome.lost - 1, 0)
                return old
            except ReformFailed as exc:
                if isinstance(exc, RanksLostMeanwhile):   # killed during the recovery: each of them counts
                    self.stats.lost_ranks += max(len(exc.ranks) - 1, 0)
                if self.relaunch is None:
                    reason = f"{self.stats.recovering}; the ranks left could not re-form: {exc}"
                    self.stats.recovering = None
                    self._impossible = True
                    raise EngineDeadError(reason) from exc
                logger.warning("the surviving ranks could not re-form (%s); restarting the job", exc)
        old.shutdown()
        try:
            return self.relaunch()
        except Exception as exc:   # noqa: BLE001 - whatever stopped the start, the engine reports it as a loss
            reason = f"{self.stats.recovering}; restarting the ranks failed: {exc}"
            self.stats.recovering = None
            raise EngineDeadError(reason) from exc

    def resume(self, client: EngineCoreClient, requests: list[RequestState], router: DPRouter) -> DPRouter:
        """The job is back: every request still running routed afresh over its DP workers (a new router: they may
        be fewer, and their caches changed) and sent with its tokens so far; the new router."""
        shape = client.shape
        router = DPRouter.for_workers(shape.dp_size, shape.num_kv_blocks, router.prefix_index is not None,
                                      shape.block_size)
        commands = resume_commands(requests, router)
        for command in commands:
            client.send(command, only_worker=command.dp_rank)
        self.finish(len(commands))
        return router

    def finish(self, resumed: int) -> None:
        seconds = time.monotonic() - self._began
        self.stats.recoveries += 1
        self.stats.recovery_seconds += seconds
        self.stats.resumed_requests += resumed
        logger.warning("recovered from %s in %.1f s; %d requests resumed", self.stats.recovering, seconds, resumed)
        self.stats.recovering = None


def resume_commands(requests: Iterable[RequestState], router: DPRouter) -> list[AddRequest]:
    """Every request still running, routed afresh (the new job's workers are empty), with its tokens so far."""
    commands = []
    for state in requests:
        decision = router.choose(state.request_id, len(state.prompt_token_ids) + len(state.token_ids), None)
        if state.token_ids:
            router.first_output(state.request_id)
        commands.append(resume_command(state, decision.dp_rank))
    return commands


def resume_command(state: RequestState, dp_rank: int) -> AddRequest:
    """`state`'s request sent to worker `dp_rank` with its tokens so far (recomputed as after a preemption); a
    prefill instance's export is exported again."""
    return AddRequest(request_id=state.request_id, prompt_token_ids=list(state.prompt_token_ids), params=state.params,
                      dp_rank=dp_rank, resumed_token_ids=list(state.token_ids), export_kv=state.export_kv)
