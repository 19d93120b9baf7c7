"""The front: one class between the callers (`LLM`, `AsyncEngine`) and the engine core, for every layout.

It owns what happens around the core: admission (the one `RequestLimits` check), DP routing (the
least-loaded or cache-aware `DPRouter`), output processing (`OutputProcessor`: detokenization, stop
strings), the front halves of P/D transfers (`PrefillFront`: handles and releases; `DecodeFront`:
imports until every rank of the worker has its KV), the engine's stats and, when a rank is lost, the restart
that resumes every request (`RankRecovery`). It talks to the core through one `EngineCoreClient`: in process
for one rank, over ZeroMQ for ranks elsewhere; both deliver the ranks' messages, which `_take` turns into outputs.

Two drivers, one at a time: a blocking caller calls `step()` (and `wait` for an expert-load snapshot or
a rebalance), or an asyncio loop `attach`es and gets outputs as messages arrive; then nothing polls: the core
client wakes the loop, a KV release wakes it from the listener's thread, and transfer deadlines are loop timers.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import random
import time
from typing import Callable

from moe_runtime.attention_dp.messages import (AbortRequest, AddRequest, ImportRequest, KVImported,
                                               ReleaseExport, ResetPrefixCache, StepOutputs)
from moe_runtime.attention_dp.router import DPRouter
from moe_runtime.load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.disaggregation.decode_front import DecodeFront
from moe_runtime.disaggregation.import_spec import ImportSpec
from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.disaggregation.prefill_front import PrefillFront, note_step_deltas
from moe_runtime.records.outputs import RequestOutput, TokenDelta
from moe_runtime.kv_blocks.prefix_hash import block_hashes
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.engine.stats import EngineHealth, EngineStats, WorkerStats
from moe_runtime.errors import EngineDeadError, InvalidRequestError
from moe_runtime.front.balancing_requests import BalancingRequests
from moe_runtime.front.core_client import EngineCoreClient
from moe_runtime.front.deadline_timer import DeadlineTimer
from moe_runtime.front.output_processor import OutputProcessor, ProcessedStep
from moe_runtime.front.front_admin import STEP_WAIT_S, FrontAdminCommands
from moe_runtime.front.front_transfers import FrontTransfers
from moe_runtime.front.inprocess_client import InProcessClient
from moe_runtime.front.rank_recovery import RankRecovery
from moe_runtime.front.weight_sync import AdminRequests
from moe_runtime.sampling.params import SamplingParams

logger = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class Admission:
    """A request checked and prepared for routing (the part of admission that may run off the event loop:
    on a 128k-token prompt the limit check and the block hashes take tens of milliseconds)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    block_hashes: list[int] | None      # the prompt's full blocks, for cache-aware routing (None: not routed so)
    import_kv: KVHandle | None = None   # decode instance: verified
    export_kv: bool = False


class Front(FrontAdminCommands, FrontTransfers):
    def __init__(self, config: EngineConfig, client: EngineCoreClient,
                 relaunch: Callable[[], EngineCoreClient] | None = None):
        """`relaunch`: starts the same job again (a lost rank then restarts the ranks: `RankRecovery`)."""
        self.config = config
        self.client = client
        shape = client.shape
        self.shape = shape
        self.tokenizer = client.tokenizer
        self.max_model_len = shape.max_model_len
        self.block_size = shape.block_size
        self.num_kv_blocks = shape.num_kv_blocks
        self.limits = RequestLimits(shape.vocab_size, shape.max_model_len, shape.kv_capacity_tokens,
                                    self.tokenizer is not None, routing=shape.routing)
        cache_aware = config.enable_prefix_caching and config.cache_aware_routing and shape.dp_size > 1
        self.router = DPRouter.for_workers(shape.dp_size, shape.num_kv_blocks, cache_aware, shape.block_size)
        self.outputs = OutputProcessor(self.tokenizer)   # the requests in flight, as the front sees them
        self.transfer_stats = TransferStats(config.disaggregation_mode)
        self.prefill: PrefillFront | None = None   # --disaggregation-mode prefill: handles, releases of parked KV
        self.decode: DecodeFront | None = None     # --disaggregation-mode decode: imports in flight
        self._dead: str | None = None
        self.recovery = RankRecovery.for_front(config, client, relaunch)
        self._undelivered: list[RequestOutput] = []     # outputs for the next step() (blocking driver)
        self._worker_stats: dict[int, WorkerStats] = {}
        self.balancing = BalancingRequests(shape.pp_size)
        self.admin = AdminRequests(config.model)   # weight updates, sleep, wake (front/weight_sync.py)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._seeds = random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None     # attached: the loop outputs go to
        self._on_outputs: Callable[[list[RequestOutput]], None] | None = None
        self._on_death: Callable[[str], None] | None = None
        self._transfer_timer = DeadlineTimer(self._transfers_due)
        if config.disaggregation_mode != "none":
            self._open_kv_transfer()

    def _open_kv_transfer(self) -> None:
        key = TransferKey.shared(self.config.kv_transfer_key_file)
        if self.config.disaggregation_mode == "prefill":
            self.prefill = PrefillFront(key, self.config.kv_transfer_host, self.config.kv_transfer_timeout_s,
                                        self.transfer_stats)
        else:
            self.decode = DecodeFront(key, self.config.kv_transfer_timeout_s, self.transfer_stats)

    def worker_shards(self, dp_rank: int) -> list[KVShard]:
        """The KV shards of DP worker `dp_rank`'s ranks (a handle's `shards`)."""
        return [self.shape.kv_shards[rank] for rank in self.shape.worker_ranks[dp_rank]]

    @property
    def core(self) -> EngineCore:
        """The engine core of a one-rank engine, which runs in this process: what tests and benchmarks inspect
        (its model, scheduler, block manager, runner, sampler). Ranks in other processes have none here."""
        if not isinstance(self.client, InProcessClient):
            raise RuntimeError(f"the engine core runs in {self.shape.world_size} rank processes, not in this one "
                               "(world_size 1 keeps it here)")
        return self.client.core

    # ---- admission ----------------------------------------------------------------------------------
    def prepare(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                export_kv: bool = False, import_kv: KVHandle | None = None) -> Admission:
        """Check a request against the engine's limits (the one check: the ranks trust what they get) and
        hash its blocks. Touches no routing state, so a loop can run it in a worker thread.

        An `import_kv` handle is claimed first (signed, unexpired, never used: else refused, nothing
        connected to); if the request is then refused, its prefill instance frees the parked KV at once."""
        self.admin.check_admission()   # asleep: refused
        if import_kv is not None:
            if self.decode is None:
                raise InvalidRequestError("kv_transfer_params: this instance is not --disaggregation-mode decode")
            import_kv = self.decode.claim(import_kv)
        try:
            self.limits.check(prompt_token_ids, params)
            if export_kv and self.prefill is None:
                raise InvalidRequestError("export_kv: this engine is not a prefill instance "
                                          "(--disaggregation-mode prefill)")
            prompt = list(prompt_token_ids)
            if import_kv is not None:
                self.decode.check_fits(import_kv, prompt, params)
            hashes = (block_hashes(prompt, self.block_size, params.cache_salt)   # the ranks' salted chain
                      if self.router.prefix_index is not None else None)
        except BaseException:
            self.refuse_import(import_kv)
            raise
        return Admission(request_id, prompt, params, hashes, import_kv, export_kv)

    def refuse_import(self, handle: KVHandle | None) -> None:
        """A request that came with `handle` will not run here (refused before or at admission): its prefill
        instance frees the parked KV now, not at its timeout (only for a handle claimed and not started, or
        still claimable: a replayed copy frees nothing)."""
        if handle is not None and self.decode is not None:
            self.decode.refuse(handle)

    def admit(self, admission: Admission) -> None:
        """Route a prepared request to a DP worker and send it to that worker's ranks."""
        if self._dead is not None or admission.request_id in self.outputs:
            self.refuse_import(admission.import_kv)
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        request_id, prompt, params = admission.request_id, admission.prompt, admission.params
        if request_id in self.outputs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.seed is None and self.shape.world_size > 1:  # the ranks of a DP worker must draw the same samples
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        if self._recovering():   # sent with the resumed requests once the ranks are back
            self.outputs.add(request_id, prompt, params, admission.export_kv)
            if admission.import_kv is not None:   # resumed from its first token: its prompt runs here
                self._output_first_token(request_id, params, self.decode.compute_here(admission.import_kv))
            self._prompt_tokens += len(prompt)
            return
        decision = self.router.choose(request_id, len(prompt), admission.block_hashes)
        if admission.import_kv is None:   # added first: a loss its send meets resumes it with the rest
            self.outputs.add(request_id, prompt, params, admission.export_kv)
            try:
                self.client.send(AddRequest(request_id=request_id, prompt_token_ids=prompt, params=params,
                                            dp_rank=decision.dp_rank, export_kv=admission.export_kv),
                                 only_worker=decision.dp_rank)
            except EngineDeadError as exc:   # attached, the client reports the loss; blocking, recover here
                if self._on_outputs is None and not self._restarted_after(str(exc)):
                    raise EngineDeadError(self._dead) from exc
        else:
            self._add_import(request_id, prompt, params, admission.import_kv, decision.dp_rank)
        self._prompt_tokens += len(prompt)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    export_kv: bool = False, import_kv: KVHandle | None = None) -> None:
        """Admit a request: `prepare` then `admit`. `export_kv` (prefill instance): its KV is parked after its
        first token and its last output carries a `kv_handle`; `import_kv` (decode instance): it was
        prefilled there, its ranks pull its KV."""
        self.admit(self.prepare(request_id, prompt_token_ids, params, export_kv, import_kv))

    def _add_import(self, request_id: str, prompt: list[int], params: SamplingParams, handle: KVHandle,
                    dp_rank: int) -> None:
        spec = ImportSpec(request_id, prompt, params, handle.first_token, handle.request_id, list(handle.shards),
                          handle.first_token_logprob(), list(handle.first_drafts))
        self.decode.start(request_id, dp_rank, set(self.shape.worker_ranks[dp_rank]), handle)
        self.client.send(ImportRequest(spec=spec, dp_rank=dp_rank), only_worker=dp_rank)
        self.outputs.add(request_id, prompt, params)
        self._output_first_token(request_id, params, handle)
        self._arm_transfer_timer()

    def _output_first_token(self, request_id: str, params: SamplingParams, handle: KVHandle) -> None:
        """An import's first token, which its prefill instance sampled: output at once."""
        first_logprob = handle.first_token_logprob()
        self._generation_tokens += 1
        self.router.grow(request_id, 1)
        self.router.first_output(request_id)
        first = TokenDelta(request_id, [handle.first_token],
                           [first_logprob] if params.logprobs is not None and first_logprob is not None else None)
        self._emit(self._outputs_of(self.outputs.process([first])))

    def abort(self, request_id: str) -> bool:
        """End a request now, for every caller and transport (the one abort: `LLM`'s callers, the server's routes
        and a client gone all come here): its ranks free its KV blocks at their next step boundary, and, attached
        to a loop, its last output (finish_reason "abort") reaches `on_outputs` before this returns, so its stream
        has ended (a blocking caller that asked knows; `step()` returns nothing more for it). Whether it was in
        flight (unknown or finished ids, and a dead engine, change nothing)."""
        if request_id not in self.outputs or self._dead is not None:
            return False
        if not self._recovering():   # else not sent again when the ranks are back
            self.client.send(AbortRequest(request_id=request_id))
        output = self.outputs.end(request_id)
        self.router.release(request_id)
        if self.decode is not None:
            self.decode.release(request_id)   # its prefill instance frees its parked copy
        if self._on_outputs is not None:
            self._on_outputs([output])
        return True

    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests) or bool(self._undelivered)

    def reset_prefix_cache(self) -> None:
        """Every DP worker forgets its cached KV blocks at its next step boundary (blocks in use stay with their
        requests); each reports it, and the cache-aware router forgets them in order."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._recovering():   # a restarted job's caches are empty
            self.client.send(ResetPrefixCache())

    # ---- messages from the core ---------------------------------------------------------------------
    def _take(self, message) -> list[RequestOutput]:
        """Apply one message from a rank to the front's state; the outputs it completes."""
        if isinstance(message, StepOutputs):
            return self._apply_step(message)
        if isinstance(message, KVImported):
            outcome = None
            if self.decode is not None:
                outcome = self.decode.landed(message.rank, message.request_id, message.error, message.num_bytes,
                                             message.seconds, message.recomputable)
            return self._settle(outcome) if outcome is not None else []
        if not self.admin.take(message):
            self.balancing.take(message)
        return []

    def _apply_step(self, batch: StepOutputs) -> list[RequestOutput]:
        self._worker_stats[batch.dp_rank] = batch.stats
        self.router.report_kv(batch.dp_rank, batch.stats.kv_blocks_free, batch.stats.kv_blocks_total)
        if batch.cache_events is not None:   # before the deltas: a first output settles what its request expected
            self.router.report_cache(batch.dp_rank, batch.cache_events)
        live = [d for d in batch.deltas if d.request_id in self.outputs]  # not aborted or stopped meanwhile
        for delta in live:
            self._generation_tokens += len(delta.new_token_ids)
            self.router.grow(delta.request_id, len(delta.new_token_ids))
            self.router.first_output(delta.request_id)
        processed = self.outputs.process(live)
        for request_id, reason in processed.ended.items():  # ended here (stop string, error): ranks free its blocks
            self.client.send(AbortRequest(request_id=request_id, finish_reason=reason))
        for output in processed.outputs:
            output.sampled_at = batch.sent_at
            if output.finished:
                self.router.release(output.request_id)
        dp_rank = batch.dp_rank
        note_step_deltas(self.prefill, self.transfer_stats, dp_rank, batch.deltas, processed.outputs,
                         lambda: self.worker_shards(dp_rank),
                         lambda request_id: self.client.send(ReleaseExport(request_id=request_id, dp_rank=dp_rank)))
        return processed.outputs

    def _outputs_of(self, processed: ProcessedStep) -> list[RequestOutput]:
        """Outputs made in the front (an import's first token, its failure); requests they ended are aborted."""
        for request_id, reason in processed.ended.items():
            self.client.send(AbortRequest(request_id=request_id, finish_reason=reason))
            if self.decode is not None:
                self.decode.release(request_id)
        for output in processed.outputs:
            if output.finished:
                self.router.release(output.request_id)
        return processed.outputs

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Outputs made outside the core's messages: to the loop (after the caller returns), or to step()."""
        if not outputs:
            return
        if self._on_outputs is not None:
            self._loop.call_soon(self._on_outputs, outputs)
        else:
            self._undelivered.extend(outputs)

    # ---- the blocking driver ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Outputs since the last call; waits briefly for at least one (an in-process core steps here)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        outputs, self._undelivered = self._undelivered, []
        outputs.extend(self._transfers_serviced())
        if outputs or not self.outputs.requests:
            return outputs
        return outputs + self._take_messages(STEP_WAIT_S)

    def _take_messages(self, timeout: float) -> list[RequestOutput]:
        try:
            messages = self.client.receive(timeout)
        except EngineDeadError as exc:
            if self._restarted_after(str(exc)):
                return []
            raise EngineDeadError(self._dead) from exc   # the whole story: the loss, and why it could not recover
        outputs = []
        for message in messages:
            outputs.extend(self._take(message))
        return outputs

    def _absorb_pending(self) -> None:
        """Blocking driver: take in what arrived while nobody called step() (its outputs are kept for it).
        Attached to a loop, messages are taken in as they arrive instead."""
        if self._dead is not None or self._on_outputs is not None:
            return
        try:
            messages = self.client.pending()
        except EngineDeadError as exc:
            self._restarted_after(str(exc))
            return
        for message in messages:
            self._undelivered.extend(self._take(message))

    def _restarted_after(self, reason: str) -> bool:
        """Blocking driver, a rank lost: restart the job here and resume its requests (True), or end the engine."""
        self._fail_futures(reason)
        if self.recovery is not None and self.recovery.begin(reason):
            try:
                self._resume(self.recovery.restart(self.client))
                return True
            except EngineDeadError as exc:   # the new job failed too: again while restarts are left
                return self._restarted_after(str(exc))
        self._dead = reason
        return False

    def wait(self, future: concurrent.futures.Future, timeout_s: float | None = None):
        """Blocking driver: take messages in until `future` (from `expert_load` or `rebalance_now`) is done; the
        outputs that arrive meanwhile are kept for the next `step()`."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.worker_timeout_s)
        while not future.done():
            if time.monotonic() > deadline:
                raise EngineDeadError("the engine did not answer in time (expert-load snapshot or rebalance)")
            self._undelivered.extend(self._take_messages(STEP_WAIT_S))
        return future.result()

    # ---- the loop driver ----------------------------------------------------------------------------
    def attach(self, on_outputs: Callable[[list[RequestOutput]], None], on_death: Callable[[str], None]) -> None:
        """From now on the running loop takes in the core's messages as they arrive: outputs go to `on_outputs`,
        and a dead core to `on_death(reason)` once. `step` and `wait` must not be used after this."""
        self._loop = self._transfer_timer.loop = asyncio.get_running_loop()
        self._on_outputs = on_outputs
        self._on_death = on_death
        if self._undelivered:
            outputs, self._undelivered = self._undelivered, []
            self._loop.call_soon(on_outputs, outputs)
        if self.prefill is not None:   # a decode instance released parked KV (the listener's thread)
            loop = self._loop
            self.prefill.wake = lambda: loop.call_soon_threadsafe(self._transfers_due)
        self.client.attach(self._on_messages, self._on_lost)
        self._arm_transfer_timer()

    def _on_messages(self, messages) -> None:
        outputs = []
        try:
            for message in messages:
                outputs.extend(self._take(message))
        except EngineDeadError:
            pass   # a send to a lost rank: the client reports the loss
        if outputs:
            self._on_outputs(outputs)
        self._arm_transfer_timer()

    def _on_lost(self, reason: str) -> None:
        self._fail_futures(reason)
        if self._dead is None and self.recovery is not None and self.recovery.begin(reason):
            self.client.detach()
            self._loop.create_task(self._restart())
            return
        self._dead = self._dead or reason
        if self._on_death is not None:
            self._on_death(self._dead)

    async def _restart(self) -> None:
        """Loop driver: the job starts again off the loop; then its requests resume (`rank_recovery.py`)."""
        try:
            self._resume(await asyncio.to_thread(self.recovery.restart, self.client))
        except EngineDeadError as exc:   # the new job failed too: again while restarts are left, else the end
            self._on_lost(str(exc))
            return
        self.client.attach(self._on_messages, self._on_lost)

    def _resume(self, client: EngineCoreClient) -> None:
        """The job is back (re-formed, maybe smaller, or restarted): its requests go on (`RankRecovery.resume`)."""
        self.client, self.shape, self._worker_stats = client, client.shape, {}
        if self.decode is not None:
            self.decode.abandon()        # imports in flight resume from their first token: their prompts run here
        if self.prefill is not None:
            self.prefill.forget_all()    # what the lost job parked is gone; its decode instances compute it instead
        if not self._weights_restored(client):   # updated in memory since the checkpoint: the requests end
            self.router = self.recovery.resume(client, [], self.router)
            return
        self.router = self.recovery.resume(client, list(self.outputs.requests.values()), self.router)

    def _recovering(self) -> bool:
        return self.recovery is not None and self.recovery.recovering

    def detach(self) -> None:
        """Stop taking messages on the loop (before shutting down)."""
        self._transfer_timer.cancel()
        self._on_outputs = None
        self.client.detach()

    # ---- load balancing -----------------------------------------------------------------------------
    def expert_load(self) -> concurrent.futures.Future:
        """An expert-load snapshot summed over every rank (a lock-step command: all ranks join), as a future
        (`ExpertLoadSnapshot`, or None for a dense model). One snapshot in flight serves every caller."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return self.balancing.expert_load(self.client.send)

    def rebalance_now(self, fail_on_rank: int | None = None) -> concurrent.futures.Future:
        """Plan from the recorded window and migrate now (all ranks, at one step boundary): a future of the
        `RebalanceEvent`. `fail_on_rank` injects a migration failure on that rank (fault-injection tests): the
        event then reports ok=False and the previous placement stays in force."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return self.balancing.rebalance_now(self.client.send, fail_on_rank)

    def rebalance_events(self) -> list[RebalanceEvent]:
        return list(self.balancing.events)

    def _fail_futures(self, reason: str | None = None) -> None:
        self.balancing.fail(reason or self._dead or "the engine stopped")
        self.admin.fail(reason or self._dead or "the engine stopped")

    # ---- state and tear-down ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Each DP worker's stats as it last reported them (after every step with work, and after an abort)."""
        self._absorb_pending()
        workers = [self._worker_stats.get(dp) or WorkerStats(dp, 0, 0, self.num_kv_blocks, self.num_kv_blocks, 0)
                   for dp in range(self.shape.dp_size)]
        return EngineStats(workers, self._prompt_tokens, self._generation_tokens, self.transfer_stats.snapshot(),
                           dataclasses.replace(self.recovery.stats) if self.recovery is not None else None)

    def health(self) -> EngineHealth:
        """The engine's health, for every transport: a lost core or rank reaches the front once (the client's
        `on_lost`, or `EngineDeadError` from a blocking call), and the front keeps what became of it. Degraded
        (healthy, serving) while the ranks restart or re-form, and while fewer ranks than the job started with
        serve; unhealthy once the engine ended, or while its weights are an update from memory no checkpoint
        holds."""
        if self._dead is not None:
            return EngineHealth(False, self._dead)
        if self._recovering():
            return EngineHealth(True, f"restarting the ranks after: {self.recovery.stats.recovering}", True)
        if self.admin.weights_lost is not None:
            return EngineHealth(False, self.admin.weights_lost)
        started, serving = (self.recovery.full_world_size if self.recovery else 0), self.shape.world_size
        if serving < started:
            return EngineHealth(True, f"serving on {serving} of {started} ranks after losing {started - serving}", True)
        return EngineHealth(True)

    def shutdown(self) -> None:
        for front in (self.prefill, self.decode):
            if front is not None:
                front.close()
        self.prefill = self.decode = None
        self._transfer_timer.cancel()
        self.client.shutdown()
