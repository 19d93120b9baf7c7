"""Continuous batching: requests join and leave every step; prefill and decode steps alternate.

A step is either a prefill batch (waiting requests admitted while KV blocks and the token budget
allow) or a decode batch (every running request adds one token). When a decode step finds no free
block, the most recently admitted request is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed from its prompt plus the tokens it already produced.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from moe_runtime.block_manager import BlockManager
from moe_runtime.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(seq.tokens_to_compute() for seq in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.waiting)

    @property
    def num_running_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.running)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """End a request before the engine would (client gone, or the front saw a stop string); frees its blocks."""
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return seq
        return None

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            seq = self.waiting[0]
            needed = seq.tokens_to_compute()
            if admitted and needed > budget:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            budget -= needed
        if not admitted:
            return None
        self.running.extend(admitted)
        return ScheduledBatch(admitted, is_prefill=True)

    def _schedule_decode(self) -> ScheduledBatch | None:
        self.running.sort(key=lambda s: s.arrival)
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        if not scheduled:
            return None
        return ScheduledBatch(scheduled, is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's blocks; it will be recomputed from its tokens so far."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted request %s (recompute %d tokens)", seq.request_id, seq.num_tokens)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
