"""One DP worker's engine core: the step loop over the parts `CoreSetup` builds (model, KV cache, scheduler, sampler);
`step()` advances every request.

It deals in token ids only: each step returns a `TokenDelta` per request that advanced, and
requests arrive already checked against `limits()`. Text, stop strings and validation are the
front's (`moe_runtime.front.Front`, over an in-process or a ranks' core client). On a
prefill instance of a P/D set it parks finished prefills' blocks for decode instances
(`PrefillExports`); on a decode instance it takes in requests prefilled there (`DecodeImports`).
"""
from __future__ import annotations

import logging
import time

import torch

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.disaggregation.import_spec import ImportSpec
from moe_runtime.engine.core_setup import CoreSetup
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.engine.scheduler import ScheduledBatch
from moe_runtime.engine.stats import WorkerStats
from moe_runtime.engine.weight_updates import WeightUpdater
from moe_runtime.errors import InvalidRequestError, error_message
from moe_runtime.execution.pipeline import broadcast_step_result, run_pipeline_step
from moe_runtime.kv_blocks.prefix_cache import PrefixCacheEvents
from moe_runtime.records.outputs import TokenDelta
from moe_runtime.records.sequence import FinishReason, Sequence
from moe_runtime.sampling.host_reads import DecodeHostReads
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.sampler import SampleResult
from moe_runtime.sampling.structured_output.grammar_waits import Readiness
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.speculative.verification import Speculation, emit_tokens

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None,
                 transfer_key: TransferKey | None = None):
        """`transfer_key`: a P/D instance's KV secret (default: from `config`: its key file or environment)."""
        self.config = config
        self.parallel = parallel or ParallelContext.single(config.resolved_device())
        self.wake = None                             # called (from another thread) when a pull or compile ended
        setup = CoreSetup.build(config, self.parallel, transfer_key, self._wake_loop)
        self.checkpoint_dir, self.hf_config = setup.checkpoint_dir, setup.hf_config
        self.architecture = setup.architecture
        self.device, self.dtype, self.kernels, self.executor = setup.device, setup.dtype, setup.kernels, setup.executor
        self.model, self.routing, self.runner = setup.model, setup.routing, setup.runner
        self.tokenizer, self.eos_ids, self.grammars = setup.tokenizer, setup.eos_ids, setup.grammars
        self.vocab_size, self.max_model_len = self.hf_config.vocab_size, setup.max_model_len
        self.block_manager, self.scheduler, self.speculation = setup.block_manager, setup.scheduler, setup.speculation
        self.sampler, self.grammar_waits, self.tier_steps = setup.sampler, setup.grammar_waits, setup.tier_steps
        self.transfers, self.tiers = setup.transfers, setup.tier_steps.tiers
        self.exports, self.imports = self.transfers.exports, self.transfers.imports   # P/D prefill / decode instance
        self.decode_host_reads = DecodeHostReads() if config.debug_host_reads else None
        self.weight_updater = WeightUpdater(self)           # weights without a restart (engine/weight_updates.py)
        self.sleep_mode = self.weight_updater.sleep         # sleep / wake_up (engine/sleep_mode.py)
        self._arrivals = 0
        self._sequences: dict[str, Sequence] = {}
        self._steps = 0
        self._step_seconds = 0.0
        self._compute_seconds = 0.0
        logger.info("engine ready: %s (%s, %s, kernels=%s) in %.2fs", self.architecture, self.device,
                    self.dtype, self.kernels.name, setup.load_seconds)

    def _wake_loop(self) -> None:
        """From another thread: a KV pull or a grammar compile ended, or a compile's deadline passed."""
        if self.wake is not None:
            self.wake()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def limits(self) -> RequestLimits:
        """What a request must fit; the front checks it once at admission, and this core trusts it."""
        return RequestLimits(self.vocab_size, self.max_model_len, self.kv_capacity_tokens,
                             self.tokenizer is not None, routing=self.routing.shape)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    export_kv: bool = False, resumed_token_ids: list[int] = ()) -> None:
        """Queue an admitted request (checked by the front). `export_kv` (prefill instance): its blocks are parked
        after its first token. `resumed_token_ids`: its output on lost ranks, continued as after a preemption."""
        if request_id in self._sequences:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if export_kv and self.exports is None:
            raise InvalidRequestError("export_kv: this engine is not a prefill instance (--disaggregation-mode prefill)")
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival=self._arrivals, export_kv=export_kv,
                       queued_at=time.perf_counter(), output_token_ids=list(resumed_token_ids),
                       prompt_logprobs_done=bool(resumed_token_ids), routing=self.routing.for_request(params))
        self._arrivals += 1
        self._sequences[request_id] = seq
        if params.structured_output is None:
            self.scheduler.add(seq)
        else:   # scheduled once its grammar compiled on every rank of this worker (`start_grammars`)
            self.grammar_waits.add(seq, params.structured_output)

    @property
    def waiting_for_grammars(self) -> bool:
        return len(self.grammar_waits) > 0

    def grammar_readiness(self) -> list[Readiness]:
        """This rank's view of the requests waiting for their grammars (the lock-step loop agrees on it)."""
        return self.grammar_waits.local_view()

    def start_grammars(self, agreed: list[Readiness]) -> int:
        """Schedule the waiting requests the ranks of this worker agree are settled (or timed out: those fail
        at their first step); how many."""
        started = self.grammar_waits.start(agreed)
        for seq in started:
            self.scheduler.add(seq)
        return len(started)

    def add_import(self, spec: ImportSpec) -> None:
        """Take in a request prefilled by a prefill instance (a decode instance): blocks are allocated and its
        KV pulled, and its grammar (structured output) compiles off this loop meanwhile; it decodes once
        `activate_import` says every rank of this worker has both."""
        if self.imports is None:
            raise InvalidRequestError("this engine is not a decode instance (--disaggregation-mode decode)")
        if spec.request_id in self._sequences:
            raise InvalidRequestError(f"request id {spec.request_id!r} is already in use")
        params = spec.params
        seq = Sequence(spec.request_id, list(spec.prompt_token_ids), params, arrival=self._arrivals,
                       queued_at=time.perf_counter())   # its grammar: once compiled (`DecodeImports.take_landed`)
        seq.output_token_ids.append(spec.first_token)
        if spec.first_logprob is not None and params.logprobs is not None:
            seq.logprobs.append(spec.first_logprob)
        self._arrivals += 1
        self._sequences[spec.request_id] = seq
        self.imports.add(seq, spec)

    @property
    def imports_in_flight(self) -> bool:
        return self.imports is not None and self.imports.in_flight

    def activate_import(self, request_id: str) -> bool:
        """Every rank of this worker has the import's KV: it decodes from the next step."""
        seq = self.imports.activate(request_id) if self.imports is not None else None
        if seq is None:
            return False
        self.scheduler.add_running(seq)
        return True

    def release_export(self, request_id: str) -> bool:
        """Free a parked request's blocks (its decode instance has them, or gave up, or it timed out)."""
        return self.exports is not None and self.exports.release(request_id)

    def drop_request(self, request_id: str, reason: str = FinishReason.ABORT.value) -> bool:
        """The rank's half of an `AbortRequest`: the request leaves this worker wherever it is (scheduled, importing,
        waiting for its grammar, parked) and its blocks are freed; `reason` ("abort", or "stop"/"error" when the
        front ended it) is its finish reason. Whether it was here."""
        self.tier_steps.stop_loads(request_id)
        seq = self.scheduler.drop(request_id, FinishReason(reason))
        if seq is None and self.imports is not None:
            seq = self.imports.cancel_pull(request_id)
            if seq is not None:
                self.imports.allocate()   # its blocks may admit an import waiting for them
        if seq is None:
            seq = self.grammar_waits.forget(request_id)
        parked = self.release_export(request_id)
        self._sequences.pop(request_id, None)
        return seq is not None or parked

    def drop_requests(self) -> None:
        """Drop every request and free every parked export (a job that lost a rank: the front resumes the requests,
        and a decode instance still pulling an export computes it itself); their full blocks stay cached."""
        for request_id in list(self._sequences):
            self.drop_request(request_id)
        if self.exports is not None:
            self.exports.release_all()

    def has_unfinished(self) -> bool:
        """Work to step: scheduled requests (a request waiting for its grammar is not, until it may start:
        alone, this core decides that itself; in lock-step, the ranks agree on it)."""
        if self.parallel.world_size == 1 and self.waiting_for_grammars:
            self.start_grammars(self.grammar_readiness())
        return self.scheduler.has_work()

    def step(self) -> list[TokenDelta]:
        """Run one batch; a delta for every request that advanced."""
        batch = self.schedule()
        if batch is None:
            return []
        return self.execute(batch)

    def _forward_and_sample(self, seqs: list[Sequence], sampling: list[Sequence]) -> SampleResult:
        """Run `seqs`' scheduled tokens; sample for `sampling`, those of them whose tokens reach their end
        (a prefill chunk that stops short of it samples nothing)."""
        if self.parallel.pp_size == 1:   # a captured decode step may sample in its graph (ModelRunner)
            return self.runner.execute_and_sample(seqs, self._sample)
        micro_batches = self.config.pp_micro_batches or self.parallel.pp_size
        result = run_pipeline_step(self.runner, seqs, self.parallel, micro_batches)
        self._compute_seconds += result.compute_seconds
        if not sampling:
            return SampleResult.empty()
        sampled = self._sample(result.logits, sampling) if self.parallel.is_last_stage else None
        return broadcast_step_result(sampled, sampling, self.parallel)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:  # logits [B, V]
        """The batch's tokens. If sampling the batch raises, each request is sampled on its own and only
        those that raise alone fail. Every rank of a DP worker runs this on the same logits and params,
        so a failure fails the same requests on every rank and their schedulers stay in step."""
        try:
            return self.sampler(logits, seqs)
        except Exception as exc:  # noqa: BLE001 - find the request(s) at fault below
            logger.warning("sampling a batch of %d requests failed (%s); sampling each on its own",
                           len(seqs), error_message(exc))
        return SampleResult.concat([self._sample_alone(logits[i : i + 1], seq) for i, seq in enumerate(seqs)])

    def _sample_alone(self, logits: torch.Tensor, seq: Sequence) -> SampleResult:  # logits [1, V]
        try:
            return self.sampler(logits, [seq])
        except Exception as exc:  # noqa: BLE001 - fails this request only
            return SampleResult.failed(error_message(exc))

    def schedule(self) -> ScheduledBatch | None:
        self.tier_steps.before_schedule()
        batch = self.scheduler.schedule()
        self.tier_steps.after_schedule()
        return batch

    def execute(self, batch: ScheduledBatch | None, phase: str | None = None) -> list[TokenDelta]:
        """Run `batch` through the model; None runs an empty batch (0 tokens) through every layer, so a
        DP worker with nothing to do still joins every collective of a lock-step."""
        seqs = batch.seqs if batch is not None else []
        sampling = [seq for seq in seqs if seq.samples_this_step]
        phase = phase or ("prefill" if batch is None or batch.is_prefill else "decode")
        started = time.perf_counter()
        for seq in seqs:
            if seq.queue_seconds is None:
                seq.queue_seconds = started - seq.queued_at
        self.executor.begin_step(phase)
        with DecodeHostReads.window(self.decode_host_reads, batch is not None and phase == "decode"):
            sampled = self._forward_and_sample(seqs, sampling)
        self.executor.end_step()
        self._steps += 1
        self._step_seconds += time.perf_counter() - started
        scored_prompts = self.runner.take_prompt_logprobs()
        deltas = []   # an empty batch has none; a model drafter still runs (its expert-parallel collectives)
        for seq, token, logprob, error, accepted in zip(sampling, sampled.token_ids, sampled.logprobs,
                                                        sampled.errors, sampled.accepted_rows()):
            if seq.params.max_tokens == 0:   # it only scores its prompt: the token sampled for it is dropped
                self.scheduler.finish(seq, FinishReason.LENGTH)
                self._sequences.pop(seq.request_id, None)
                deltas.append(TokenDelta(seq.request_id, [], None, FinishReason.LENGTH.value, None, seq.num_preemptions,
                                         prompt_logprobs=scored_prompts.get(seq.request_id)))
                continue
            if error is None and seq.grammar is not None:
                error = seq.grammar.accept(token)  # every rank alike: they agree on when the grammar ends
            if error is not None:
                deltas.append(self._fail(seq, error))
                continue
            tokens, logprobs, reason = emit_tokens(seq, [*accepted, (token, logprob)], self.scheduler.advance,
                                                 self.block_manager)
            export = None
            routed = self.routing.new_rows(seq)   # routing replay: the rows final since its last delta
            if reason is not None:
                park = reason == FinishReason.LENGTH and seq.export_kv
                self.scheduler.finish(seq, reason, keep_blocks=park)
                self._sequences.pop(seq.request_id, None)
                export = self.exports.park(seq) if park else None
            deltas.append(TokenDelta(seq.request_id, tokens, logprobs if seq.params.logprobs is not None else None,
                                     reason.value if reason else None, None, seq.num_preemptions,
                                     prompt_logprobs=scored_prompts.get(seq.request_id), kv_export=export,
                                     routed_experts=routed, **self._first_delta_fields(seq)))
        Speculation.after_step(self.speculation, self.runner.last_hidden, sampling)   # a model drafter drafts (MTP)
        if self.exports is not None:
            self.exports.note_drafts()   # ... parked requests' too: their handles carry them
        if self.imports is not None:
            self.imports.allocate()   # finished requests freed blocks an import may be waiting for
        return deltas

    @staticmethod
    def _first_delta_fields(seq: Sequence) -> dict:
        """What a request's first delta alone carries: its queue time and the prompt tokens its prefix cache held."""
        if seq.queue_reported or seq.queue_seconds is None:
            return {}
        seq.queue_reported = True
        return {"queue_seconds": seq.queue_seconds, "cached_prompt_tokens": seq.kv.prefix_hit_tokens}

    def _fail(self, seq: Sequence, error: str) -> TokenDelta:
        """End a request the engine could not advance: its KV blocks are freed as for an abort, and its
        delta says finish_reason "error" with `error` (the other requests of the batch go on)."""
        logger.warning("request %s failed: %s", seq.request_id, error)
        self.scheduler.finish(seq, FinishReason.ERROR)
        self._sequences.pop(seq.request_id, None)
        return TokenDelta(seq.request_id, [], None, "error", error, seq.num_preemptions)

    def worker_stats(self) -> WorkerStats:
        return WorkerStats(
            dp_rank=self.parallel.dp_rank,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.scheduler.landed),
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            steps=self._steps,
            step_seconds=self._step_seconds,
            moe_comm_seconds=self.executor.comm_seconds,
            compute_seconds=self._compute_seconds if self.parallel.pp_size > 1 else self._step_seconds,
            prefix_cache_queries=self.block_manager.counters.queries,
            prefix_cache_hits=self.block_manager.counters.hits,
            **self.tier_steps.stats_fields(),
            **self.runner.capture_stats(), **DecodeHostReads.stats(self.decode_host_reads),
            **Speculation.stats(self.speculation),
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (those in use stay with their requests), in the tiers too; the idle blocks
        freed."""
        self.tier_steps.clear()
        return self.block_manager.reset_prefix_cache()

    def take_prefix_cache_events(self) -> PrefixCacheEvents | None:
        """What this worker's prefix cache stored, evicted or cleared since the last call (None: caching off). With
        KV tiers a block is held while the device or a tier holds it: the front's router counts a prefix in host
        memory or on disk as this worker's."""
        return self.tier_steps.router_events(self.block_manager.take_cache_events())

    def expert_load(self, group=None):
        """The expert-load snapshot (summed over `group`'s ranks when given), or None for a dense model."""
        recorder = self.executor.recorder
        return None if recorder is None else recorder.snapshot(group=group)

    def resident_expert_bytes(self) -> tuple[int, int]:
        """(bytes of routed-expert weights on this rank, bytes of all routed experts of its MoE layers)."""
        return self.executor.resident_expert_bytes()

    def shutdown(self) -> None:
        self._sequences.clear()
        self.weight_updater.close()   # the trainer's group, if joined: its threads must not outlive the engine
        self.tier_steps.close()
        self.grammar_waits.close()
        for transfer in (self.exports, self.imports):
            if transfer is not None:
                transfer.close()
        self.exports = self.imports = None
