"""The front of a multi-rank job: starts one worker process per rank, routes requests to DP
attention workers, collects their outputs, and detects dead ranks.

Implements the same `Engine` face as the in-process `EngineCore`, so `LLM` and the server drive
either one. Commands are broadcast to every rank (each applies them at the same lock-step
boundary); a request lives on the ranks of the DP worker the router chose. As a P/D instance it
keeps the front half of KV transfers (`PrefillFront`: handles, releases; `DecodeFront`: imports
until every rank of the worker has its KV) and turns their events into broadcast commands.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import msgspec

from attention_dp.control_key import ControlKey
from attention_dp.control_plane import ControlAddress, FrontControl, RankDisconnected
from attention_dp.messages import (AbortRequest, ActivateImport, AddRequest, ExpertLoadReport, ImportRequest,
                                   KVImported, RebalanceNow, RebalanceReport, ReleaseExport, ResetPrefixCache,
                                   Shutdown, SnapshotExpertLoad, StepOutputs, WorkerFailed, WorkerReady, WorkerSetup)
from attention_dp.router import DPRouter
from load_balancer.rebalance_event import RebalanceEvent
from load_balancer.recorder import ExpertLoadSnapshot
from moe_runtime.disaggregation.decode_front import DecodeFront, ImportOutcome
from moe_runtime.processes.distributed import free_port
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import load_tokenizer
from moe_runtime.front.engine_protocol import EngineHealth, EngineStats, WorkerStats
from moe_runtime.errors import EngineDeadError, InvalidRequestError
from moe_runtime.disaggregation.import_spec import ImportSpec
from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.disaggregation.kv_transfer.keys import TransferKey
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.stats import TransferStats
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.front.output_processor import OutputProcessor, ProcessedStep
from moe_runtime.disaggregation.prefill_front import PrefillFront, note_step_deltas
from moe_runtime.engine.prefix_hash import block_hashes
from moe_runtime.engine.outputs import RequestOutput, TokenDelta
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.processes.worker import worker_main

logger = logging.getLogger(__name__)

STEP_WAIT_S = 0.05   # step() returns after this with no outputs, so the offline caller can apply commands
TRANSFER_TICK_S = 0.1   # P/D instance on a loop: how often releases and transfer deadlines are looked at
DEATH_REPORT_GRACE_S = 0.3  # after a rank exits, time for its last message (WorkerFailed) to be taken in


@contextmanager
def main_module_hidden():
    """Start workers without re-running the user's script in them.

    Spawned children normally re-import `__main__` (so a script without an `if __name__ ==
    "__main__"` guard would start the job again in every worker). The workers' entry point lives
    in this package and needs nothing from `__main__`, so its file is hidden while they start.
    """
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        if "__file__" in saved:
            delattr(main, "__file__")
        main.__spec__ = None
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def merge_stage_snapshots(snapshots: list):
    """One snapshot over all MoE layers from the pipeline stages' snapshots (stage order = layer order)."""
    present = [s for s in snapshots if s is not None]
    if len(present) <= 1:
        return present[0] if present else None
    import torch

    first = present[0]
    joined = {name: torch.cat([getattr(s, name) for s in present]) for name in
              ("counts", "totals", "rank_load", "balancedness", "max_over_mean", "placement")}
    return dataclasses.replace(first, **joined)


# What the workers' fork server imports once. `transformers.activations` is what a model's config class pulls
# in when the checkpoint's config is read (2-3 s of imports behind transformers' lazy modules).
WORKER_PRELOAD = ("torch", "transformers", "transformers.activations", "moe_runtime.processes.worker", "moe_runtime.engine.core",
                  "attention_dp.lockstep", "moe_runtime.moe.executor")


def worker_context():
    """Workers fork from a server process that has already imported torch and the engine (started
    once per front process): a new job's ranks start in well under a second instead of re-importing
    torch each. Forking from that clean server, never from the front, keeps CUDA and threads sane."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


class MultiprocessEngine:
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0):
        self.config = config
        self.hf_config = load_hf_config(config.model)
        self.layout = config.layout()
        self.layout.validate(self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.tokenizer = load_tokenizer(Path(config.model))
        self._dead: str | None = None
        self._undelivered: list[RequestOutput] = []     # produced while waiting for something else
        self._load_reports: dict[int, ExpertLoadSnapshot | None] = {}   # pipeline stage -> its snapshot
        self._load_waiter: asyncio.Future | None = None
        self._rebalance_waiter: asyncio.Future | None = None
        self._loop_tasks: list[asyncio.Task] = []
        self.outputs = OutputProcessor(self.tokenizer)   # the requests in flight, as the front sees them
        self._worker_stats: dict[int, WorkerStats] = {}
        self._rebalance_events: list[RebalanceEvent] = []
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._seeds = random.Random()
        self._on_outputs: Callable[[list[RequestOutput]], None] | None = None   # attached to a loop: where outputs go
        self.transfer_stats = TransferStats(config.disaggregation_mode)
        self.prefill: PrefillFront | None = None   # --disaggregation-mode prefill: handles, releases of parked KV
        self.decode: DecodeFront | None = None     # --disaggregation-mode decode: imports in flight
        self._transfer_key = (TransferKey.shared(config.kv_transfer_key_file)
                              if config.disaggregation_mode != "none" else None)
        self._start_workers(startup_timeout_s)
        self._open_kv_transfer()

    # ---- start-up and tear-down -------------------------------------------------------------
    def _start_workers(self, timeout_s: float) -> None:
        world, nnodes = self.layout.world_size, self.config.nnodes
        if world % nnodes:
            raise InvalidRequestError(f"nnodes={nnodes} must divide the {world} ranks of this layout")
        local_ranks = world // nnodes if self.config.launch_workers else 0  # the front's node starts [0, local)
        self._rendezvous_dir: str | None = None
        if nnodes == 1 and self.config.launch_workers:
            # every rank is our child: a fresh secret, and nothing of the job listens beyond loopback
            # (torch.distributed meets in a file store in a private directory, not a TCP store)
            key = ControlKey.generate()
            self._rendezvous_dir = tempfile.mkdtemp(prefix="moe-rendezvous-")  # mode 0700
            rendezvous, master_port = f"file://{self._rendezvous_dir}/store", 0
            control = ControlAddress.ipc(f"{self._rendezvous_dir}/control", key)
        else:  # other nodes' or torchrun's ranks connect to master_addr:control_port with the shared key
            key = ControlKey.shared(self.config.control_key_file)
            rendezvous, master_port = "env://", self.config.master_port or free_port(self.config.master_addr)
            control = ControlAddress.tcp(self.config.master_addr, self.config.control_port or master_port + 1, key)
        setup = WorkerSetup(config=self.config, world_size=world, rendezvous=rendezvous,
                            master_addr=self.config.master_addr, master_port=master_port,
                            num_threads=max(1, (os.cpu_count() or 1) // max(local_ranks, world // nnodes)),
                            log_level=logging.getLogger().getEffectiveLevel(),
                            loopback_only=self._rendezvous_dir is not None,
                            kv_secret=self._transfer_key.key.secret if self._transfer_key is not None else b"")
        self._control = FrontControl(control, setup)
        address = self._control.address.for_local_ranks()
        context = worker_context()
        self._processes: dict[int, mp.Process] = {}
        for rank in range(local_ranks):
            process = context.Process(target=worker_main, args=(address, rank), name=f"moe-worker-{rank}",
                                      daemon=True)
            with main_module_hidden():
                process.start()
            self._processes[rank] = process
        logger.info("started %d of %d worker ranks (ep=%d, dp_attn=%d, tp=%d, pp=%d), rendezvous %s, "
                    "control %s", local_ranks, world, self.layout.ep, self.layout.dp_attn, self.layout.tp,
                    self.layout.pp, rendezvous if self._rendezvous_dir else f"{self.config.master_addr}:{master_port}",
                    self._control.address.endpoint)
        self.ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(self.ready) < world:
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"worker ranks {sorted(set(range(world)) - set(self.ready))} "
                                          f"did not start within {timeout_s:.0f}s")
                message = self._next_message(timeout=0.2)
                if isinstance(message, WorkerReady):
                    self.ready[message.rank] = message
                    logger.info("rank %d ready (%d/%d)", message.rank, len(self.ready), world)
                elif message is not None:
                    logger.warning("rank message %s before the job started; dropped", type(message).__name__)
        except BaseException:
            self._kill_workers()
            self._control.close()
            self._remove_rendezvous()
            raise
        first = self.ready[0]
        self.block_size = first.block_size
        self.num_kv_blocks = min(r.num_kv_blocks for r in self.ready.values())
        self.max_model_len = first.max_model_len
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, self.num_kv_blocks * self.block_size,
                                    self.tokenizer is not None)
        cache_aware = self.config.enable_prefix_caching and self.config.cache_aware_routing and self.layout.dp_size > 1
        self.router = DPRouter.for_workers(self.layout.dp_size, self.num_kv_blocks, cache_aware, self.block_size)
        self.worker_ranks: dict[int, list[int]] = {}      # DP worker -> its ranks (every stage), in rank order
        for rank in sorted(self.ready):
            self.worker_ranks.setdefault(self.ready[rank].dp_rank, []).append(rank)

    def _open_kv_transfer(self) -> None:
        config = self.config
        if config.disaggregation_mode == "none":
            return
        try:
            key = self._transfer_key
            if config.disaggregation_mode == "prefill":
                self.prefill = PrefillFront(key, config.kv_transfer_host, config.kv_transfer_timeout_s,
                                            self.transfer_stats)
            else:
                self.decode = DecodeFront(key, config.kv_transfer_timeout_s, self.transfer_stats)
        except BaseException:
            self.shutdown()
            raise

    def worker_shards(self, dp_rank: int) -> list[KVShard]:
        """The KV shards of DP worker `dp_rank`'s ranks (a handle's `shards`)."""
        return [self.ready[rank].kv_shard for rank in self.worker_ranks[dp_rank]]

    def _kill_workers(self) -> None:
        for process in self._processes.values():
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 5
        for process in self._processes.values():
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                process.kill()
                process.join(timeout=1)

    def shutdown(self) -> None:
        for front in (self.prefill, self.decode):
            if front is not None:
                front.close()
        self.prefill = self.decode = None
        if not getattr(self, "_processes", None) and not getattr(self, "_control", None):
            return
        self._control.detach_from_loop()  # the loop that used it may be gone: shut down with blocking sends
        if self._dead is None:
            try:
                self._control.broadcast(Shutdown())
            except RankDisconnected:
                pass
            deadline = time.monotonic() + 10
            for process in self._processes.values():
                process.join(timeout=max(deadline - time.monotonic(), 0.1))
            # ranks started elsewhere (another node, torchrun) must read the Shutdown before the socket goes
            self._control.wait_for_ranks_to_leave(max(deadline - time.monotonic(), 0.1))
        self._kill_workers()
        self._control.close()  # remote ranks see the connection close and exit
        self._remove_rendezvous()
        self._processes = {}
        self._control = None

    def _remove_rendezvous(self) -> None:
        if getattr(self, "_rendezvous_dir", None):
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None

    # ---- messages from the workers -----------------------------------------------------------
    def _next_message(self, timeout: float):
        """The next message from any worker; raises EngineDeadError if a rank failed or died."""
        try:
            received = self._control.receive(timeout)
        except RankDisconnected as lost:
            self._report_failure_sent_before_exit()
            self._die(self._describe_lost_rank(lost.rank))
        if received is None:
            self._check_alive()
            return None
        _, message = received
        if isinstance(message, WorkerFailed):
            self._die(self._root_cause(message), message.traceback)
        return message

    def _handle(self, message) -> list[RequestOutput]:
        """Apply one message from a rank to the front's state; the outputs it completes."""
        if isinstance(message, StepOutputs):
            return self._apply_step(message)
        if isinstance(message, KVImported):
            outcome = None
            if self.decode is not None:
                outcome = self.decode.landed(message.rank, message.request_id, message.error, message.num_bytes,
                                             message.seconds)
            return self._settle(outcome) if outcome is not None else []
        if isinstance(message, RebalanceReport):
            self._rebalance_events.append(message.event)
            if self._rebalance_waiter is not None and not self._rebalance_waiter.done():
                self._rebalance_waiter.set_result(self._rebalance_events[-1])
        elif isinstance(message, ExpertLoadReport):
            self._load_reports[message.stage] = (None if message.tables is None else
                                                 ExpertLoadSnapshot.from_dict(msgspec.structs.asdict(message.tables)))
            if (len(self._load_reports) == self.layout.pp and self._load_waiter is not None
                    and not self._load_waiter.done()):
                self._load_waiter.set_result(None)
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
            self._control.broadcast(AbortRequest(request_id=request_id, finish_reason=reason))
        for output in processed.outputs:
            output.sampled_at = batch.sent_at
            if output.finished:
                self.router.release(output.request_id)
        dp_rank = batch.dp_rank
        note_step_deltas(self.prefill, self.transfer_stats, dp_rank, batch.deltas, processed.outputs,
                         lambda: self.worker_shards(dp_rank),
                         lambda request_id: self._control.broadcast(ReleaseExport(request_id=request_id,
                                                                                  dp_rank=dp_rank)))
        return processed.outputs

    # ---- KV transfers (P/D instances) --------------------------------------------------------
    def _service_transfers(self) -> list[RequestOutput]:
        """Apply releases and transfer deadlines (the ranks' pull outcomes arrive as messages: `_handle`)."""
        if self._dead is not None:
            return []
        if self.prefill is not None:
            for parked in self.prefill.take_due():
                self._control.broadcast(ReleaseExport(request_id=parked.request_id, dp_rank=parked.dp_rank))
        outputs: list[RequestOutput] = []
        if self.decode is not None:
            for outcome in self.decode.take_expired():
                outputs.extend(self._settle(outcome))
        return outputs

    def _settle(self, outcome: ImportOutcome) -> list[RequestOutput]:
        """Every rank of the worker has the import's KV: decode it; or one failed: fail it alone, on every rank."""
        if outcome.error is None:
            self._control.broadcast(ActivateImport(request_id=outcome.request_id, dp_rank=outcome.dp_rank))
            return []
        self._control.broadcast(AbortRequest(request_id=outcome.request_id, finish_reason="error"))
        self.router.release(outcome.request_id)
        return self._outputs_of(self.outputs.process([TokenDelta(outcome.request_id, [], None, "error",
                                                                 outcome.error)]))

    def _outputs_of(self, processed: ProcessedStep) -> list[RequestOutput]:
        """Outputs made in the front (an import's first token, its failure); requests they ended are aborted."""
        for request_id, reason in processed.ended.items():
            self._control.broadcast(AbortRequest(request_id=request_id, finish_reason=reason))
            if self.decode is not None:
                self.decode.abort(request_id)
        for output in processed.outputs:
            if output.finished:
                self.router.release(output.request_id)
        return processed.outputs

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Outputs made outside the ranks' messages: to the loop (after the caller returns), or to step()."""
        if not outputs:
            return
        if self._on_outputs is not None:
            asyncio.get_running_loop().call_soon(self._on_outputs, outputs)
        else:
            self._undelivered.extend(outputs)

    def _describe_lost_rank(self, rank: int) -> str:
        process = self._processes.get(rank)
        if process is not None:
            process.join(timeout=1.0)
            return f"worker rank {rank} died (exit code {process.exitcode})"
        return f"worker rank {rank} lost its connection to the front (its process or node died)"

    def _root_cause(self, failed: WorkerFailed) -> str:
        """A rank whose collective broke because a peer died reports first: name the dead peer."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rank, process in self._processes.items():
                if rank != failed.rank and process.exitcode not in (None, 1):
                    return (f"worker rank {rank} died (exit code {process.exitcode}); "
                            f"rank {failed.rank} then failed: {failed.error}")
            time.sleep(0.05)
        return f"worker rank {failed.rank} failed: {failed.error}"

    def _check_alive(self) -> None:
        for rank, process in self._processes.items():
            if not process.is_alive():
                self._report_failure_sent_before_exit()
                self._die(f"worker rank {rank} died (exit code {process.exitcode})")

    def _report_failure_sent_before_exit(self) -> None:
        """A rank that raised sends WorkerFailed and then exits: prefer its message to a bare exit code."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                received = self._control.receive(0.1)
            except RankDisconnected:
                continue
            if received is None:
                return
            message = received[1]
            if isinstance(message, WorkerFailed):
                self._die(self._root_cause(message), message.traceback)
            self._undelivered.extend(self._handle(message))

    def _die(self, reason: str, detail: str = ""):
        if self._dead is None:
            self._dead = reason
            logger.error("%s; stopping the other ranks%s", reason, f"\n{detail}" if detail else "")
            self._kill_workers()
        raise EngineDeadError(self._dead)

    # ---- the Engine face ---------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    export_kv: bool = False, import_kv: KVHandle | None = None) -> None:
        """Admit a request: the one check (`RequestLimits`) happens here; the ranks trust what they get.

        `export_kv` (prefill instance): its KV is parked after its first token and its last output carries a
        `kv_handle`; `import_kv` (decode instance): it was prefilled there, its ranks pull its KV."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self.outputs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.limits.check(prompt_token_ids, params)
        if export_kv and self.prefill is None:
            raise InvalidRequestError("export_kv: this engine is not a prefill instance (--disaggregation-mode prefill)")
        if import_kv is not None:
            if self.decode is None:
                raise InvalidRequestError("kv_transfer_params: this instance is not --disaggregation-mode decode")
            import_kv = self.decode.verify(import_kv, list(prompt_token_ids), params)
        if params.seed is None:  # the ranks of a DP worker must draw the same samples
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        hashes = block_hashes(prompt_token_ids, self.block_size) if self.router.prefix_index is not None else None
        decision = self.router.choose(request_id, len(prompt_token_ids), hashes)
        prompt = list(prompt_token_ids)
        if import_kv is None:
            self._control.broadcast(AddRequest(request_id=request_id, prompt_token_ids=prompt, params=params,
                                               dp_rank=decision.dp_rank, export_kv=export_kv))
            self.outputs.add(request_id, prompt, params)
        else:
            self._add_import(request_id, prompt, params, import_kv, decision.dp_rank)
        self._prompt_tokens += len(prompt_token_ids)

    def _add_import(self, request_id: str, prompt: list[int], params: SamplingParams, handle: KVHandle,
                    dp_rank: int) -> None:
        first_logprob = handle.first_logprob.token_logprob() if handle.first_logprob is not None else None
        spec = ImportSpec(request_id, prompt, params, handle.first_token, handle.request_id, list(handle.shards),
                          first_logprob, handle.generator_state)
        self._control.broadcast(ImportRequest(spec=spec, dp_rank=dp_rank))
        self.outputs.add(request_id, prompt, params)
        self.decode.start(request_id, dp_rank, set(self.worker_ranks[dp_rank]), handle)
        self._generation_tokens += 1
        self.router.grow(request_id, 1)
        self.router.first_output(request_id)
        first = TokenDelta(request_id, [handle.first_token],
                           [first_logprob] if params.logprobs is not None and first_logprob is not None else None)
        self._emit(self._outputs_of(self.outputs.process([first])))

    def abort(self, request_id: str) -> bool:
        if request_id not in self.outputs or self._dead is not None:
            return False
        self._control.broadcast(AbortRequest(request_id=request_id))
        self.outputs.abort(request_id)
        self.router.release(request_id)
        if self.decode is not None:
            self.decode.abort(request_id)   # its prefill instance frees its parked copy
        return True

    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests)

    def reset_prefix_cache(self) -> None:
        """Every DP worker forgets its cached KV blocks at its next lock-step boundary (blocks in use stay
        with their requests); each reports it, and the cache-aware router forgets them in order."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._control.broadcast(ResetPrefixCache())

    def step(self) -> list[RequestOutput]:
        """Outputs the workers produced since the last call; waits briefly for at least one."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        outputs, self._undelivered = self._undelivered, []
        outputs.extend(self._service_transfers())
        if outputs or not self.outputs.requests:
            return outputs
        message = self._next_message(timeout=STEP_WAIT_S)  # returns as soon as a rank reports
        while message is not None:
            outputs.extend(self._handle(message))
            message = self._next_message(timeout=0)
        return outputs

    def expert_load(self):
        """Expert-load counts summed over every rank (a lock-step command: all ranks join)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._load_reports = {}
        self._control.broadcast(SnapshotExpertLoad())
        deadline = time.monotonic() + self.config.worker_timeout_s
        while len(self._load_reports) < self.layout.pp:
            if time.monotonic() > deadline:
                raise EngineDeadError("no expert-load report from every pipeline stage in time")
            message = self._next_message(timeout=deadline - time.monotonic())
            self._undelivered.extend(self._handle(message))
        return self._merged_load_reports()

    def _merged_load_reports(self):
        return merge_stage_snapshots([self._load_reports[s] for s in range(self.layout.pp)])

    def rebalance_now(self, fail_on_rank: int | None = None) -> RebalanceEvent:
        """Plan from the recorded window and migrate now (all ranks, at one step boundary).

        `fail_on_rank` injects a migration failure on that rank (fault-injection tests): the event
        then reports ok=False and the previous placement stays in force.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        seen = len(self._rebalance_events)
        self._control.broadcast(RebalanceNow(fail_on_rank=fail_on_rank))
        deadline = time.monotonic() + self.config.worker_timeout_s
        while len(self._rebalance_events) == seen:
            if time.monotonic() > deadline:
                raise EngineDeadError("no rebalance report from rank 0 in time")
            message = self._next_message(timeout=deadline - time.monotonic())
            self._undelivered.extend(self._handle(message))
        return self._rebalance_events[-1]

    def rebalance_events(self) -> list[RebalanceEvent]:
        return list(self._rebalance_events)

    def stats(self) -> EngineStats:
        """Each DP worker's stats as it last reported them (after every step with work, and after an abort)."""
        self._absorb_pending()
        workers = [self._worker_stats.get(dp) or WorkerStats(dp, 0, 0, self.num_kv_blocks, self.num_kv_blocks, 0)
                   for dp in range(self.layout.dp_size)]
        return EngineStats(workers, self._prompt_tokens, self._generation_tokens, self.transfer_stats.snapshot())

    def _absorb_pending(self) -> None:
        """Take in what arrived while nobody called step() (outputs are kept for it). Attached to a loop,
        messages are taken in as they arrive instead."""
        if self._dead is not None or self._control is None or self._loop_tasks:
            return
        message = self._next_message(timeout=0)
        while message is not None:
            self._undelivered.extend(self._handle(message))
            message = self._next_message(timeout=0)

    def health(self) -> EngineHealth:
        if self._dead is not None:
            return EngineHealth(False, self._dead)
        for rank, process in self._processes.items():
            if not process.is_alive():
                return EngineHealth(False, f"worker rank {rank} died (exit code {process.exitcode})")
        return EngineHealth(True)

    # ---- event-driven use: AsyncEngine attaches the engine to its asyncio loop ----------------------
    def attach(self, on_outputs: Callable[[list[RequestOutput]], None], on_death: Callable[[str], None]) -> None:
        """From now on the running loop takes in each rank message as it arrives (no thread, no polling):
        outputs go to `on_outputs`, and a failed or dead rank to `on_death(reason)` once. The blocking
        `step`, `expert_load` and `rebalance_now` must not be used after this: use the `_async` ones."""
        loop = asyncio.get_running_loop()
        self._control.attach_to_loop()
        self._on_outputs = on_outputs
        self._loop_tasks = [loop.create_task(self._take_messages(on_outputs, on_death)),
                            loop.create_task(self._watch_ranks(on_death))]
        if self.prefill is not None or self.decode is not None:
            self._loop_tasks.append(loop.create_task(self._tick_transfers(on_outputs)))

    async def _tick_transfers(self, on_outputs) -> None:
        """Releases from decode instances and transfer deadlines, looked at every TRANSFER_TICK_S."""
        while self._dead is None:
            await asyncio.sleep(TRANSFER_TICK_S)
            try:
                outputs = self._service_transfers()
            except RankDisconnected:
                continue   # _watch_ranks names the rank
            if outputs:
                on_outputs(outputs)

    async def _take_messages(self, on_outputs, on_death) -> None:
        try:
            while self._dead is None:
                _, message = await self._control.receive_async()
                if isinstance(message, WorkerFailed):
                    await asyncio.to_thread(self._stop_after_failure, message)
                    break
                outputs = self._handle(message)
                if outputs:
                    on_outputs(outputs)
        except RankDisconnected:
            return  # _watch_ranks names the rank
        except Exception as exc:  # noqa: BLE001 - the front cannot go on without its ranks' messages
            logger.exception("control-plane reader failed")
            self._stop_after(f"the front lost its control plane: {exc}")
        self._fail_waiters()
        on_death(self._dead)

    async def _watch_ranks(self, on_death) -> None:
        """Wake when a local rank process exits or any rank's connection closes; then stop the job."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future = loop.create_future()
        for rank, process in self._processes.items():
            loop.add_reader(process.sentinel, lambda r=rank: exited.done() or exited.set_result(r))
        disconnected = loop.create_task(self._control.wait_for_disconnect())
        try:
            await asyncio.wait([exited, disconnected], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for process in self._processes.values():
                loop.remove_reader(process.sentinel)
            disconnected.cancel()
        rank = exited.result() if exited.done() else disconnected.result()
        await asyncio.sleep(DEATH_REPORT_GRACE_S)  # a rank that raised sends WorkerFailed just before exiting
        if self._dead is None:
            await asyncio.to_thread(self._stop_after, self._describe_lost_rank(rank))
            self._fail_waiters()
            on_death(self._dead)

    def _stop_after_failure(self, failed: WorkerFailed) -> None:
        self._stop_after(self._root_cause(failed), failed.traceback)

    def _stop_after(self, reason: str, detail: str = "") -> None:
        try:
            self._die(reason, detail)
        except EngineDeadError:
            pass

    def _fail_waiters(self) -> None:
        for waiter in (self._load_waiter, self._rebalance_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(EngineDeadError(self._dead or "the engine stopped"))

    async def expert_load_async(self):
        """`expert_load()` on the loop: the lock-step snapshot command, awaited."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._load_waiter is not None and not self._load_waiter.done():
            await asyncio.shield(self._load_waiter)  # one snapshot in flight serves every caller
            return self._merged_load_reports()
        self._load_reports = {}
        self._load_waiter = asyncio.get_running_loop().create_future()
        self._control.broadcast(SnapshotExpertLoad())
        await asyncio.wait_for(asyncio.shield(self._load_waiter), self.config.worker_timeout_s)
        return self._merged_load_reports()

    async def rebalance_now_async(self, fail_on_rank: int | None = None) -> RebalanceEvent:
        """`rebalance_now()` on the loop."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._rebalance_waiter is not None and not self._rebalance_waiter.done():
            return await asyncio.shield(self._rebalance_waiter)
        self._rebalance_waiter = asyncio.get_running_loop().create_future()
        self._control.broadcast(RebalanceNow(fail_on_rank=fail_on_rank))
        return await asyncio.wait_for(asyncio.shield(self._rebalance_waiter), self.config.worker_timeout_s)

    def detach(self) -> None:
        """Stop taking messages on the loop (before shutting down)."""
        for task in self._loop_tasks:
            task.cancel()
        self._on_outputs = None
        if self._control is not None:
            self._control.detach_from_loop()

    def resident_expert_bytes(self) -> dict[int, tuple[int, int]]:
        return {rank: (r.expert_bytes, r.total_expert_bytes) for rank, r in self.ready.items()}
