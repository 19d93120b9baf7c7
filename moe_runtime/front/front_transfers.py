"""The front's side of KV transfers between P/D instances (`Front` takes these methods): a prefill instance's parked
exports released when due, a decode instance's imports settled (decoded, recomputed here, or failed alone), one
loop timer at the earliest deadline."""
from __future__ import annotations

import logging

from moe_runtime.attention_dp.messages import AbortRequest, ActivateImport, ReleaseExport
from moe_runtime.disaggregation.decode_front import ImportOutcome
from moe_runtime.records.outputs import RequestOutput, TokenDelta
from moe_runtime.errors import EngineDeadError
from moe_runtime.front.rank_recovery import resume_command

logger = logging.getLogger(__name__)


class FrontTransfers:
    """Mixed into `Front` (its client, outputs, router, prefill / decode fronts and drivers)."""

    def _service_transfers(self) -> list[RequestOutput]:
        """Apply releases and transfer deadlines (the ranks' pull outcomes arrive as messages: `_take`)."""
        if self._dead is not None or self._recovering():   # the job that held them is gone (`_resume`)
            return []
        if self.prefill is not None:
            for parked in self.prefill.take_due():
                self.client.send(ReleaseExport(request_id=parked.request_id, dp_rank=parked.dp_rank))
        outputs: list[RequestOutput] = []
        if self.decode is not None:
            for outcome in self.decode.take_expired():
                outputs.extend(self._settle(outcome))
        return outputs

    def _settle(self, outcome: ImportOutcome) -> list[RequestOutput]:
        """Every rank of the worker has the import's KV: decode it. Its transfer failed: the worker drops the import
        and computes the prompt itself, from the first token on (`ImportOutcome.recompute`). Else (its grammar
        failed) it fails alone, on every rank."""
        if outcome.error is None:
            self.client.send(ActivateImport(request_id=outcome.request_id, dp_rank=outcome.dp_rank))
            return []
        state = self.outputs.requests.get(outcome.request_id)
        if outcome.recompute and state is not None:
            logger.warning("request %s: %s; its prompt runs here instead", outcome.request_id, outcome.error)
            self.client.send(AbortRequest(request_id=outcome.request_id))
            self.client.send(resume_command(state, outcome.dp_rank), only_worker=outcome.dp_rank)
            return []
        self.client.send(AbortRequest(request_id=outcome.request_id, finish_reason="error"))
        self.router.release(outcome.request_id)
        return self._outputs_of(self.outputs.process([TokenDelta(outcome.request_id, [], None, "error",
                                                                 outcome.error)]))

    def _transfers_serviced(self) -> list[RequestOutput]:
        """Blocking driver: `_service_transfers`, where a send may be the first to meet a lost rank (a release due
        to the rank that was just killed): recovered as a loss a receive met."""
        try:
            return self._service_transfers()
        except EngineDeadError as exc:
            if self._restarted_after(str(exc)):
                return []
            raise EngineDeadError(self._dead) from exc

    def _transfers_due(self) -> None:
        """A release arrived or a transfer deadline passed: apply it now (on the loop)."""
        try:
            outputs = self._service_transfers()
        except EngineDeadError:
            return   # the client reports the loss
        if outputs and self._on_outputs is not None:
            self._on_outputs(outputs)
        self._arm_transfer_timer()

    def _arm_transfer_timer(self) -> None:
        """One loop timer at the earliest transfer deadline (a parked export's, an import's), instead of a tick."""
        self._transfer_timer.arm(front.next_deadline for front in (self.prefill, self.decode) if front is not None)
