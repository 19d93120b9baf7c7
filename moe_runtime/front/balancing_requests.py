"""The front's questions to the load balancer: an expert-load snapshot and a rebalance, each as a future.

Both are lock-step commands every rank joins; the answers come back as rank messages (`ExpertLoadReport` per
pipeline stage, `RebalanceReport` from rank 0), which `take` settles. One snapshot and one rebalance in flight
serve every caller; a lost engine (or a restarting one) fails what is in flight with its reason.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable

import msgspec

from moe_runtime.attention_dp.messages import (ExpertLoadReport, Message, RebalanceNow, RebalanceReport,
                                               SnapshotExpertLoad)
from moe_runtime.load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.load_balancer.recorder import ExpertLoadSnapshot
from moe_runtime.errors import EngineDeadError
from moe_runtime.front.stage_snapshots import merge_stage_snapshots


class BalancingRequests:
    def __init__(self, pp_size: int):
        self.pp_size = pp_size
        self.events: list[RebalanceEvent] = []
        self._load_reports: dict[int, ExpertLoadSnapshot | None] = {}   # pipeline stage -> its snapshot
        self._load_future: concurrent.futures.Future | None = None
        self._rebalance_future: concurrent.futures.Future | None = None

    def expert_load(self, send: Callable[[Message], None]) -> concurrent.futures.Future:
        """A future `ExpertLoadSnapshot` summed over every rank (None for a dense model)."""
        if self._load_future is None or self._load_future.done():
            self._load_reports = {}
            self._load_future = concurrent.futures.Future()
            send(SnapshotExpertLoad())
        return self._load_future

    def rebalance_now(self, send: Callable[[Message], None], fail_on_rank: int | None) -> concurrent.futures.Future:
        """A future `RebalanceEvent` of a rebalance planned from the recorded window and migrated now."""
        if self._rebalance_future is None or self._rebalance_future.done():
            self._rebalance_future = concurrent.futures.Future()
            send(RebalanceNow(fail_on_rank=fail_on_rank))
        return self._rebalance_future

    def take(self, message: Message) -> bool:
        """Settle what `message` answers; whether it was one of these answers."""
        if isinstance(message, RebalanceReport):
            self.events.append(message.event)
            if self._rebalance_future is not None and not self._rebalance_future.done():
                self._rebalance_future.set_result(message.event)
            return True
        if isinstance(message, ExpertLoadReport):
            self._load_reports[message.stage] = (None if message.tables is None else
                                                 ExpertLoadSnapshot.from_dict(msgspec.structs.asdict(message.tables)))
            future = self._load_future
            if len(self._load_reports) == self.pp_size and future is not None and not future.done():
                future.set_result(merge_stage_snapshots([self._load_reports[s] for s in range(self.pp_size)]))
            return True
        return False

    def fail(self, reason: str) -> None:
        for future in (self._load_future, self._rebalance_future):
            if future is not None and not future.done():
                future.set_exception(EngineDeadError(reason))
