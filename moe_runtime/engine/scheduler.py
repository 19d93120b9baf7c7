"""Continuous batching: requests join and leave every step.

Each scheduled sequence gets `num_scheduled_tokens` for the step: a whole prompt, a chunk of one,
or the single token a decoding request sampled last. Two policies:

- **chunked prefill** (`enable_chunked_prefill`): every step runs every running decode, then the
  prefills in progress, then newly admitted requests, the prefills cut to what is left of the
  token budget (`max_num_batched_tokens`). A long prompt is split over several steps; its request
  samples only after its last chunk. Decodes never wait behind a long prompt.
- **alternating** (chunked prefill off): a step is either a prefill batch (waiting requests admitted
  whole while KV blocks and the token budget allow) or a decode batch.

Admission reserves KV blocks for the whole sequence; with prefix caching, its longest cached prefix
is reused (`BlockManager.admit`) and only the rest is computed. A request asking for prompt
logprobs reads nothing from the cache (every prompt position must go through the model). Each
scheduled full block is registered in the prefix cache as it is scheduled: the step writes a layer's
K/V for all its tokens before any attention read in that layer, so a request admitted later in the
same step can already reuse it.

With speculative decoding (`drafter`), a decoding sequence may compute its last token and the drafts proposed
after it in one step (1 + d tokens; blocks for all of them), when blocks and the step's token budget allow
(else it decodes one token). A step whose sequences all decode, with or without drafts, is still a
"decode"-phase step (DeepEP's low-latency dispatch, the captured step): its rows stay within the decode bound,
`EngineConfig.decode_max_tokens` (max_num_seqs x (1 + k), and no more than the token budget lets drafts take).

When a decode finds no free block, the most recently admitted request is preempted: its blocks are
freed (cached ones stay cached) and it goes back to the front of the queue, to be recomputed from
its prompt plus the tokens it already produced.

With KV tiers, a request whose admission found part of its prefix in a tier (`seq.kv.tier_loads`) holds its blocks in
`loading`, scheduled nowhere, while the engine brings the entries back (moe_runtime/kv_tiers/engine_tiers.py); then
it is `ready` (`loaded`), holding its blocks, and starts computing the rest of its prompt at the next prefill
scheduling, ahead of the waiting queue (which might otherwise hold a request that cannot fit beside it, forever).
The others keep stepping meanwhile. A load that failed on some rank gives its blocks back (`load_failed`) and the
request is admitted afresh. Loading and ready requests count against `max_num_seqs`.

The stop checks are here too: the core hands each sampled token to `advance`, which appends it and says whether
the request ends (EOS, a stop token, a completed grammar, max_tokens); stop strings are the front's.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.records.sequence import FinishReason, Sequence, SequenceStatus
from moe_runtime.sampling.logprobs import TokenLogprob

logger = logging.getLogger(__name__)

PHASE_PREFILL = "prefill"   # some sequence computes prompt tokens or recomputes its output (dispatch: any size)
PHASE_DECODE = "decode"     # every sequence computes its last token and its drafts, if any (<= decode_max_tokens)


class Drafter(Protocol):
    def drafts_for(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens to verify after `seq`'s last token this step (at most `budget`)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    enable_chunked_prefill: bool = False
    eos_token_ids: tuple[int, ...] = ()   # the model's: a request stops at one unless its params ignore EOS


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]           # each with its num_scheduled_tokens for this step

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_scheduled_tokens for seq in self.seqs)

    @property
    def phase(self) -> str:
        """"decode" when every sequence decodes: its last token, and the drafts it verifies (1 + d tokens, all
        logits rows), else "prefill" (mixed steps included): the expert dispatch picks its mode by it, and a
        decode mode may bound the tokens per rank (`EngineConfig.decode_max_tokens`, drafts counted)."""
        if all(seq.is_decoding and seq.num_scheduled_tokens == seq.logit_rows for seq in self.seqs):
            return PHASE_DECODE
        return PHASE_PREFILL

    @property
    def is_prefill(self) -> bool:
        return self.phase == PHASE_PREFILL


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, drafter: Drafter | None = None):
        self.config = config
        self.block_manager = block_manager
        self.drafter = drafter                     # speculative decoding (None: off)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.landed: deque[Sequence] = deque()    # a decode instance's imports, holding their blocks, waiting for
        self.num_preemptions = 0                  # room under max_num_seqs (`add_running`)
        self.loading: list[Sequence] = []         # admitted from the KV tiers, holding blocks, waiting for the loads
        self.ready: deque[Sequence] = deque()     # ... loaded, holding blocks, to start at the next prefill scheduling
        self._started_loading: list[Sequence] = []   # ... of which admitted since `take_started_loading`

    def advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> FinishReason | None:
        """Append a sampled token (and its logprob) and say whether the request is done."""
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        return self.finish_reason(seq, token)

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """EOS, a stop token, a completed grammar or max_tokens; stop strings are the front's (`OutputProcessor`)."""
        params = seq.params
        generated = len(seq.output_token_ids)
        if seq.grammar is not None and seq.grammar.terminated:
            return FinishReason.STOP  # the grammar was complete and its stop token accepted (ignore_eos or not)
        if generated >= params.min_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
                return FinishReason.STOP
        if generated >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.landed or self.loading or self.ready)

    @property
    def num_admitted(self) -> int:
        """Requests holding a place under max_num_seqs: running ones, and those loading from the tiers or loaded."""
        return len(self.running) + len(self.loading) + len(self.ready)

    def take_started_loading(self) -> list[Sequence]:
        """The requests admitted from the tiers since the last call (their loads are to start)."""
        started, self._started_loading = self._started_loading, []
        return started

    def loaded(self, seqs: list[Sequence]) -> None:
        """Their loads are back on every rank: ready, in arrival order, holding their blocks."""
        for seq in sorted(seqs, key=lambda s: s.arrival):
            self.loading.remove(seq)
            seq.kv.tier_loads = []
            self.ready.append(seq)

    def load_failed(self, seq: Sequence) -> None:
        """Its load failed on some rank: its blocks go back and it is admitted afresh (the failed entries are
        forgotten, so a shorter prefix, or none, is found)."""
        self.loading.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.waiting)

    @property
    def num_running_tokens(self) -> int:
        return sum(seq.num_tokens for seq in self.running)

    def drop(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """End a request before the engine would (client gone, or the front saw a stop string); frees its blocks."""
        for queue in (self.waiting, self.running, self.landed, self.loading, self.ready):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return seq
        return None

    def schedule(self) -> ScheduledBatch | None:
        while self.landed and self.num_admitted < self.config.max_num_seqs:
            self.running.append(self.landed.popleft())
        if self.config.enable_chunked_prefill:
            return self._schedule_mixed()
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """`seq` computes `num_tokens` this step; its windowed groups hold what the step reads, and the blocks
        they fill are cached now, so that a request scheduled after it in this step can reuse them."""
        seq.num_scheduled_tokens = num_tokens
        self.block_manager.schedule_tokens(seq, num_tokens)
        return num_tokens

    # ---- chunked prefill: decodes, prefills in progress, new requests, under one token budget -----------
    def _schedule_mixed(self) -> ScheduledBatch | None:
        self.running.extend(self.ready)   # back from the tiers: they compute the rest of their prompts as prefills
        self.ready.clear()
        self.running.sort(key=lambda s: s.arrival)
        scheduled = self._schedule_decodes([seq for seq in self.running if seq.is_decoding])
        budget = self.config.max_num_batched_tokens - sum(seq.num_scheduled_tokens for seq in scheduled)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status == SequenceStatus.RUNNING and not seq.is_decoding:
                budget -= self._schedule_tokens(seq, min(seq.tokens_to_compute(), budget))
                scheduled.append(seq)
        while self.waiting and budget > 0 and self.num_admitted < self.config.max_num_seqs:
            seq = self.waiting[0]
            admitted = self._admit(seq)
            if admitted is None:
                break
            if admitted:
                budget -= self._schedule_tokens(seq, min(seq.tokens_to_compute(), budget))
                scheduled.append(seq)
        return ScheduledBatch(scheduled) if scheduled else None

    # ---- alternating prefill and decode steps ---------------------------------------------------------
    def _schedule_prefill(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.ready:   # back from the tiers, holding their blocks: first, whatever waits
            seq = self.ready[0]
            if admitted and seq.num_tokens > budget:
                break
            self.ready.popleft()
            self.running.append(seq)
            budget -= self._schedule_tokens(seq, seq.tokens_to_compute())
            admitted.append(seq)
        while self.waiting and self.num_admitted < self.config.max_num_seqs:
            seq = self.waiting[0]
            if admitted and seq.num_tokens > budget:   # counted whole: a cache hit only makes it cheaper
                break
            outcome = self._admit(seq)
            if outcome is None:
                break
            if outcome:
                budget -= self._schedule_tokens(seq, seq.tokens_to_compute())
                admitted.append(seq)
        return ScheduledBatch(admitted) if admitted else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        self.running.sort(key=lambda s: s.arrival)
        scheduled = self._schedule_decodes(list(self.running))
        return ScheduledBatch(scheduled) if scheduled else None

    def _schedule_decodes(self, seqs: list[Sequence]) -> list[Sequence]:
        """One token for each of `seqs` (oldest first), preempting the newest running request while a
        decode finds no free block."""
        scheduled: list[Sequence] = []
        budget = self.config.max_num_batched_tokens - len(seqs)   # what drafts may take (one token each decode)
        for seq in seqs:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            drafts = self._schedule_with_drafts(seq, budget) if self.drafter is not None else 0
            if drafts:
                budget -= drafts
                scheduled.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.append_slot(seq)
                self._schedule_tokens(seq, 1)
                scheduled.append(seq)
        return scheduled

    def _schedule_with_drafts(self, seq: Sequence, budget: int) -> int:
        """Schedule `seq`'s last token and its drafts when their blocks are free without preempting anyone
        (nothing scheduled otherwise: it then decodes as usual); the drafts it took."""
        drafts = self.drafter.drafts_for(seq, max(budget, 0))
        seq.drafts.token_ids = []
        if not drafts or not self.block_manager.can_append(seq, len(drafts)):
            return 0
        self.block_manager.append_slot(seq, len(drafts))
        seq.drafts.token_ids = drafts
        self._schedule_tokens(seq, 1 + len(drafts))
        return len(drafts)

    # ---- admission, preemption, the end ---------------------------------------------------------------
    def _admit(self, seq: Sequence) -> bool | None:
        """Blocks for `seq` (its cached prefix reused unless it wants its prompt scored); into the running set
        (True), or into `loading` when part of its prefix comes from the KV tiers (False); None: no room.
        A prompt is scored before the first token is sampled; that test reads the same on every rank (only
        the last pipeline stage scores, so only it knows `prompt_logprobs_done`)."""
        wants_prompt_scored = seq.params.prompt_logprobs is not None and not seq.output_token_ids
        # routing replay records (or forces) every position's routing: a cached prefix was not routed by it
        if not self.block_manager.admit(seq, read_cache=not wants_prompt_scored and seq.routing is None):
            return None
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        if seq.kv.tier_loads:
            self.loading.append(seq)
            self._started_loading.append(seq)
            return False
        self.running.append(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's blocks; it will be recomputed from its tokens so far."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.partial_prompt_logprobs = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted request %s (recompute %d tokens)", seq.request_id, seq.num_tokens)

    def finish(self, seq: Sequence, reason: FinishReason, keep_blocks: bool = False) -> None:
        """The request is done here; its blocks are freed unless `keep_blocks` (a prefill instance parks them
        for a decode instance to pull, and frees them on release: `PrefillExports`)."""
        for queue in (self.running, self.landed):
            if seq in queue:
                queue.remove(seq)
        self._finish(seq, reason, keep_blocks)

    def add_running(self, seq: Sequence) -> None:
        """A request that already holds its blocks and computed tokens (a decode instance's import): it joins the
        running set at the next step with room under max_num_seqs, so a decode step never holds more sequences
        than the decode bound sizes (DeepEP low-latency buffers, captured buckets) however many imports land."""
        seq.status = SequenceStatus.RUNNING
        self.landed.append(seq)

    def _finish(self, seq: Sequence, reason: FinishReason, keep_blocks: bool = False) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not keep_blocks:
            self.block_manager.free(seq)
