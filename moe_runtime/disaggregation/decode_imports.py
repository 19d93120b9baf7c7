"""A decode instance's rank-side half of a KV transfer: allocate blocks, pull the prefill's KV, then decode.

An imported request arrives as an `ImportSpec` (its prompt, the first token the prefill instance
sampled, its sampler state, and where the prompt's KV blocks are). Each rank of the DP worker
allocates blocks for it through its block manager (first come, first served, as blocks free up),
plans which prefill rank serves each of its (layer, heads) pieces (`kv_transfer.plan`: the two
instances may split heads and layers differently) and hands the pull to its `KVSink`, which writes
the blocks on its own thread (a hybrid model's recurrent states too, into the state slot its admission took:
`kv_transfer.state_plan`). The request joins the running batch only on `activate`, a command
the front sends once every rank of the worker has its KV; a failure on any rank fails it on all
(`cancel_pull`). Every change to the block manager happens at a lock-step boundary or a step, in the same
order on every rank of the worker, so their block managers never diverge (a pull that failed on one
rank keeps its blocks until the front's abort reaches all of them).

An import with structured output compiles its grammar meanwhile, off the stepping loop
(`ImportGrammars`); this rank reports its pull's end only once the grammar is ready too, with the
grammar's error if it failed, so the front activates the request only when every rank can mask it.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable


from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.disaggregation.import_grammars import ImportGrammars
from moe_runtime.disaggregation.import_spec import ImportSpec
from moe_runtime.disaggregation.kv_transfer.plan import plan_pulls
from moe_runtime.disaggregation.kv_transfer.puller import PullJob, PullResult
from moe_runtime.disaggregation.kv_transfer.shard import KVLayoutError, KVShard
from moe_runtime.disaggregation.kv_transfer.state_plan import plan_state_pulls
from moe_runtime.disaggregation.kv_transfer.transport import KVSink
from moe_runtime.records.sequence import Sequence


logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Import:
    seq: Sequence
    spec: ImportSpec
    error: str | None = None                # known before any pull (a bad sampler state, no plan)
    result: PullResult | None = None        # set when the pull ended (ok or not)
    reported: bool = False                  # ... and handed to the front


class DecodeImports:
    def __init__(self, local: KVShard, sink: KVSink, block_manager: BlockManager, spread: int, timeout_s: float,
                 grammars: ImportGrammars):
        self.local = local                  # this rank's share of the cache
        self.sink = sink
        self.block_manager = block_manager
        self.spread = spread                # this rank's attention-TP rank: spreads pulls over replicas
        self.timeout_s = timeout_s
        self.grammars = grammars            # imports' grammars compiling: their reports wait for them
        self._waiting: deque[Import] = deque()      # no blocks yet, in arrival order
        self._imports: dict[str, Import] = {}
        # called once an import has its blocks, before its pull writes them: cached blocks the allocation reused go
        # down to the KV tiers first (moe_runtime/engine/tier_steps.py; nothing without tiers)
        self.before_pull: Callable[[], None] = lambda: None

    def add(self, seq: Sequence, spec: ImportSpec, error: str | None = None) -> None:
        """Take in an import (at a lock-step boundary); it gets blocks as soon as enough are free. With `error`
        (the request cannot go on here) it still takes its turn for blocks, then fails: the front aborts it.
        Its grammar, if it has one, starts compiling now; `seq.grammar` is set when it is reported."""
        entry = Import(seq, spec, error)
        if error is None and spec.params.structured_output is not None:
            self.grammars.add(seq, spec.params.structured_output, spec.first_token)
        self._imports[seq.request_id] = entry
        self._waiting.append(entry)
        self.allocate()

    def allocate(self) -> None:
        """Blocks for waiting imports, oldest first, while they fit; start their pulls. Called at lock-step
        boundaries and after steps, so every rank of the worker allocates alike."""
        while self._waiting:
            entry = self._waiting[0]
            if not self.block_manager.admit(entry.seq, read_cache=False):
                return
            self._waiting.popleft()
            self.before_pull()
            if entry.error is None:
                try:
                    sources = plan_pulls(self.local, entry.spec.shards, self.spread)
                    state_sources = plan_state_pulls(self.local, entry.spec.shards, self.spread)
                except KVLayoutError as exc:
                    entry.error = str(exc)
            if entry.error is not None:
                entry.result = PullResult(entry.seq.request_id, entry.error, 0, 0.0)
                continue
            self.sink.submit(PullJob(entry.seq.request_id, entry.spec.source_request_id, list(entry.seq.kv.block_table),
                                     len(entry.seq.prompt_token_ids), sources, self.timeout_s,
                                     state_sources=state_sources, state_slot=entry.seq.kv.state_slot))

    def take_landed(self) -> list[PullResult]:
        """Outcomes of imports that ended since the last call, each once. Nothing is freed here: a failed
        import keeps its blocks until the front's abort, which every rank of the worker applies alike. A pull
        that landed waits for its grammar to be ready; the grammar's error, if any, is then its outcome."""
        for result in self.sink.take_landed():
            entry = self._imports.get(result.request_id)
            if entry is not None and entry.result is None:
                entry.result = result
        landed = []
        for request_id, entry in self._imports.items():
            if entry.result is None or entry.reported:
                continue
            if entry.result.error is None and request_id in self.grammars:
                if not self.grammars.ready(request_id):
                    continue
                error = self.grammars.finish(request_id)
                if error is not None:
                    entry.result = PullResult(request_id, error, entry.result.num_bytes, entry.result.seconds,
                                              recomputable=False)
            entry.reported = True
            landed.append(entry.result)
        return landed

    def activate(self, request_id: str) -> Sequence | None:
        """The request whose KV landed on every rank of the worker, ready to decode (None if unknown or failed)."""
        entry = self._imports.get(request_id)
        if entry is None or entry.result is None or entry.result.error is not None:
            return None
        del self._imports[request_id]
        seq = entry.seq
        seq.num_cached_tokens = len(seq.prompt_token_ids)
        self.block_manager.cache_full_blocks(seq, seq.num_cached_tokens)   # its prompt blocks serve later prefixes
        if entry.spec.first_drafts:   # the prefill's model drafter's: the first step verifies them (`draft_layer`)
            seq.drafts.proposed, seq.drafts.proposed_at = list(entry.spec.first_drafts), seq.num_tokens
        return seq

    def cancel_pull(self, request_id: str) -> Sequence | None:
        """Drop an import wherever it is: its pull writes nothing more, its blocks are freed. The sequence, or None."""
        entry = self._imports.pop(request_id, None)
        if entry is None:
            return None
        if any(waiting is entry for waiting in self._waiting):
            self._waiting.remove(entry)
        self.sink.cancel(request_id)           # no write into its blocks after this returns
        self.grammars.forget(request_id)       # its compile, if still queued, is cancelled
        self.block_manager.free(entry.seq)
        return entry.seq

    @property
    def in_flight(self) -> bool:
        """Some import has not reported its outcome yet (the lock-step loop keeps watching for it)."""
        return any(not entry.reported for entry in self._imports.values())

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._imports

    def __len__(self) -> int:
        return len(self._imports)

    def close(self) -> None:
        self.grammars.close()
        self.sink.close()
