"""The front's side of weight updates, sleep and wake (`Front` takes these methods; front/weight_sync.py holds the
commands and their bookkeeping, `Front.admin`): one command at a time to every rank, the running requests drained
or ended, and what a lost rank means once the weights no longer come from a checkpoint."""
from __future__ import annotations

import concurrent.futures
from typing import Callable

from moe_runtime.attention_dp.messages import AbortRequest, Message, UpdateWeights
from moe_runtime.records.outputs import RequestOutput
from moe_runtime.errors import EngineDeadError, InvalidRequestError
from moe_runtime.front.core_client import EngineCoreClient

STEP_WAIT_S = 0.05   # step() returns after this with no outputs, so a blocking caller can send commands


class FrontAdminCommands:
    """Mixed into `Front` (its client, outputs, router, admin bookkeeping and drivers)."""

    def admin_command(self, make: Callable[[int], Message], after=None) -> concurrent.futures.Future:
        """Send the command `make(update_id)` to every rank: a future of their `AdminResult` (`after(result)` runs
        first, on success). One at a time: the drivers serialize them."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._recovering():
            raise InvalidRequestError("the engine is restarting after a lost rank; retry once it is back")
        if self.admin.busy:
            raise InvalidRequestError("another weight update, sleep or wake_up is in progress")
        return self.admin.send(make(self.admin.next_id()), self.client.send, self.shape.world_size, after)

    def abort_all(self) -> int:
        """End every request in flight now (finish_reason "abort", delivered as any output); how many."""
        request_ids = list(self.outputs.requests)
        for request_id in request_ids:
            self.client.send(AbortRequest(request_id=request_id))
        self._emit(self._end_all(None))
        return len(request_ids)

    def finish_running(self) -> None:
        """Blocking driver: step until every request in flight has finished (their outputs kept for step())."""
        while self.outputs.requests:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._undelivered.extend(self._transfers_serviced())
            self._undelivered.extend(self._take_messages(STEP_WAIT_S))

    def _weights_restored(self, client: EngineCoreClient) -> bool:
        """After a lost rank: whether the requests in flight may resume. The ranks recovered from a checkpoint;
        when an update from memory changed the weights since, none describes them and the requests end here
        (False); when the last full update came from another checkpoint, that one is loaded again first."""
        origin = self.admin.origin
        if not origin.exact or self.admin.weights_lost is not None:
            reason = self.admin.weights_lost or self.admin.lose_weights(
                "a rank was lost after a weight update from memory (tensors or a trainer's broadcast): the ranks "
                f"recovered from {origin.checkpoint}, which no longer describes the weights")
            self._emit(self._end_all(reason))
            return False
        if origin.checkpoint != str(self.config.model):   # recovery read the start-up checkpoint: load the update's
            reload = self.admin.send(UpdateWeights(update_id=self.admin.next_id(), path=origin.checkpoint),
                                     client.send, client.shape.world_size)   # applied before the requests resume
            reload.add_done_callback(self._reloaded)
        return True

    def _reloaded(self, reload: concurrent.futures.Future) -> None:
        """The recovery's reload of the last full update's checkpoint failed: its requests cannot go on."""
        if reload.cancelled() or reload.exception() is None or self._dead is not None:
            return
        if isinstance(reload.exception(), EngineDeadError):   # lost again: that recovery decides (the origin
            return                                            # is not exact now: `AdminRequests.fail`)
        reason = self.admin.lose_weights(f"after a lost rank, reloading the weights from "
                                         f"{self.admin.origin.checkpoint} failed ({reload.exception()})")
        try:
            for request_id in list(self.outputs.requests):
                self.client.send(AbortRequest(request_id=request_id))
        except EngineDeadError:
            return   # lost again: that recovery ends them
        self._emit(self._end_all(reason))

    def _end_all(self, reason: str | None) -> list[RequestOutput]:
        """Every request in flight ends in the front (finish_reason "abort", `reason` as its error)."""
        outputs = []
        for request_id in list(self.outputs.requests):
            output = self.outputs.end(request_id, reason)
            self.router.release(request_id)
            if self.decode is not None:
                self.decode.release(request_id)
            if output is not None:
                outputs.append(output)
        return outputs
