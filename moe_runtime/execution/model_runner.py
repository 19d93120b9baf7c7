"""Runs one scheduled batch through the model: builds the flattened inputs and attention metadata,
owns the paged KV cache tensors, returns next-token logits per sequence (and scores the prompts of
requests that asked for prompt logprobs, kept until the engine core takes them)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.sampling.device_draw import DeviceDraw, SampleResult
from moe_runtime.sampling.graph_sampling import GraphSampling
from moe_runtime.sampling.host_reads import step_result_transfer
from moe_runtime.sampling.logprobs import PromptLogprobs
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.execution.decode_capture import CaptureSettings, CaptureStats, CapturedStep, DecodeCapture
from moe_runtime.execution.decode_carry import DecodeCarry, PaddedStep
from moe_runtime.execution.step_inputs import StepInputs, TargetHidden
from moe_runtime.kv_blocks.kv_groups import KVCacheLayout
from moe_runtime.kv_blocks.state_snapshots import SnapshotPoolSize
from moe_runtime.layers.compressed_cache import CompressedAttentionSpec, LayerCompressedCache
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.layers.state_cache import LayerStateCache, StateSpec
from moe_runtime.sampling.prompt_logprobs import chunk_tokens_for, join_prompt_logprobs, prompt_logprobs_due, score_prompt
from moe_runtime.records.sequence import Sequence
from moe_runtime.moe.routing_record import StepRouting
from moe_runtime.records.draft_checkpoints import DraftCheckpoints

logger = logging.getLogger(__name__)


def kv_blocks_for_budget(model, budget_bytes: int, block_size: int, dtype: torch.dtype,
                         kv_layout: KVCacheLayout | None = None) -> int:
    """Blocks of the full KV group that fit in `budget_bytes` once the windowed groups' fixed pools (each with
    its scratch block) and the linear-attention layers' state slots (with theirs, and the prefix cache's state
    snapshots: `SnapshotPoolSize`) are paid for, and a drafter's layers (`kv_layout.drafter_layers`) beside the full
    ones. A pipeline stage without full layers fits as many as the budget's bytes: the other stages decide."""
    kv_layout = kv_layout or KVCacheLayout.single()
    full_per_token = window_bytes = compressed_per_block = 0
    specs = model.kv_cache_specs()
    compressed = [spec for spec in specs if isinstance(spec, CompressedAttentionSpec)]
    if compressed and kv_layout.drafter_layers:   # DeepSeek-V4's MTP layer: at most the largest layer's bytes
        window_bytes += kv_layout.drafter_layers * max(spec.bytes_per_slot(dtype) for spec in compressed) * state_rows(
            kv_layout.state_slots)
        compressed_per_block += kv_layout.drafter_layers * max(spec.bytes_per_block(block_size, dtype)
                                                               for spec in compressed)
    for spec in specs:
        if isinstance(spec, CompressedAttentionSpec):   # entries paged with the full group, the rest per sequence
            window_bytes += spec.bytes_per_slot(dtype) * state_rows(kv_layout.state_slots)
            compressed_per_block += spec.bytes_per_block(block_size, dtype)
            continue
        if isinstance(spec, StateSpec):
            window_bytes += spec.bytes_per_slot(dtype) * state_rows(kv_layout.state_slots, kv_layout.draft_checkpoints)
            continue
        group = kv_layout.groups.group_of_span(spec.span)
        if group == 0:
            if full_per_token == 0:   # a drafter's layers (the MTP layer) are shaped like the first full layer
                full_per_token += kv_layout.drafter_layers * spec.bytes_per_token(dtype)
            full_per_token += spec.bytes_per_token(dtype)
        else:
            window_bytes += spec.bytes_per_token(dtype) * block_size * (kv_layout.window_blocks[group - 1] + 1)
    left = budget_bytes - window_bytes
    per_block = full_per_token * block_size + compressed_per_block
    if per_block == 0:
        return max(left // block_size, 0)
    return max(left // per_block, 0)


def state_rows(state_slots: int, draft_checkpoints: int = 0) -> int:
    """Rows of each linear layer's state tensors: the slots, a scratch one, the snapshot pool's, then
    speculation's checkpoints (`draft_checkpoints` per slot: moe_runtime/records/draft_checkpoints.py)."""
    return draft_checkpoint_rows(state_slots, draft_checkpoints).first_row + state_slots * draft_checkpoints


def draft_checkpoint_rows(state_slots: int, per_slot: int) -> DraftCheckpoints:
    return DraftCheckpoints(state_slots + 1 + SnapshotPoolSize().of(state_slots), per_slot)


@dataclass
class ExecutedStep:
    logits: torch.Tensor               # [R, V] fp32 next-token logits of the sequences that sample
    draw: DeviceDraw | None = None     # their tokens, when the captured graph sampled them
    carry: PaddedStep | None = None    # ... and the next step's inputs it computed (decode_carry.py)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 capture: CaptureSettings | None = None, kv_layout: KVCacheLayout | None = None):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        kv_layout = kv_layout or KVCacheLayout.single()
        self.groups = kv_layout.groups
        self.window_blocks = kv_layout.window_blocks   # each windowed group's pool; its scratch block is the next one
        self.state_slots = kv_layout.state_slots       # recurrent-state slots (linear-attention layers), + 1 scratch
        self.draft_checkpoints = draft_checkpoint_rows(self.state_slots, kv_layout.draft_checkpoints)
        # A captured decode step pads its batch; the pad rows write to one scratch block past the managed ones.
        allocated = num_blocks + (1 if capture is not None else 0)
        self.caches = []
        for spec in model.kv_cache_specs():
            if isinstance(spec, StateSpec):
                self.caches.append(LayerStateCache.allocate(
                    spec, state_rows(self.state_slots, kv_layout.draft_checkpoints), dtype, device))
                continue
            if isinstance(spec, CompressedAttentionSpec):
                self.caches.append(LayerCompressedCache.allocate(spec, allocated, block_size,
                                                                 state_rows(self.state_slots), dtype, device))
                continue
            group = self.groups.group_of_span(spec.span)
            blocks = allocated if group == 0 else self.window_blocks[group - 1] + 1
            self.caches.append(LayerKVCache.allocate(spec, blocks, block_size, dtype, device, group))
        if capture is not None and (self.state_slots or self.groups.hybrid):   # make_engine refuses these first
            raise EngineConfigError("--enable-torch-compile with this model: its " + (
                "linear-attention layers keep recurrent states" if self.state_slots else
                "windowed KV cache groups beside the full one keep block tables") + ", which a captured step does "
                "not take yet (front/model_options.py)")
        self.capture = None if capture is None else DecodeCapture(model, self.caches, block_size, num_blocks,
                                                                   device, capture)
        # a steady captured batch's next inputs, computed by its previous step's graph
        self.carry = None if capture is None else DecodeCarry(block_size, dynamic_width=capture.table_width is None)
        self.prompt_logprobs_chunk_tokens = chunk_tokens_for(model.hf_config.vocab_size)
        self._scored_prompts: dict[str, PromptLogprobs] = {}   # request id -> prompt logprobs not yet taken
        # a drafter layer keeping per-sequence state (DeepSeek-V4's MTP layer): restored from a cached prefix's
        # snapshot and snapshotted at the step's boundaries like the model's compressed caches
        self.drafter_state_caches: list[LayerCompressedCache] = []
        # a captured decode step samples its tokens itself where the batch lets it (GraphSampling.refusal)
        self.sample_in_graph = True
        self.keep_hidden = False                      # a drafter reads each step's hidden states (MTP, EAGLE-3)
        self.last_hidden: TargetHidden | None = None  # ... the last step's (eager or captured), when asked
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, block_size, self.cache_bytes() / 2**20)

    def capture_stats(self) -> dict:
        """The `WorkerStats` fields of the captured decode step (none without one)."""
        return CaptureStats.worker_fields(self.capture)

    def cache_bytes(self) -> int:
        total = 0
        for cache in self.caches:
            if isinstance(cache, (LayerStateCache, LayerCompressedCache)):
                total += cache.nbytes()
                continue
            total += cache.keys.numel() * cache.keys.element_size()
            if cache.values is not None:
                total += cache.values.numel() * cache.values.element_size()
        return total

    def prepare(self, seqs: list[Sequence]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            start = seq.num_cached_tokens
            input_ids.extend(seq.scheduled_token_ids())   # a prefill chunk, the whole rest, or the one decode token
            positions.extend(range(start, start + seq.num_scheduled_tokens))
        dev = self.device
        batch = AttentionBatch.over_ranges([seq.kv.block_table for seq in seqs], [seq.num_cached_tokens for seq in seqs],
                                           [seq.num_cached_tokens + seq.num_scheduled_tokens for seq in seqs],
                                           self.block_size, dev)
        batch.prompt_lens = [len(seq.prompt_token_ids) for seq in seqs]
        query_start = batch.query_start
        if self.state_slots:
            self._start_states(seqs, batch)
        if self.groups.hybrid:
            batch.group_views = [self._window_view(batch, seqs, group) for group in range(1, len(self.groups.groups))]
        last = torch.tensor([row for stop, seq in zip(query_start[1:], seqs) if seq.samples_this_step
                             for row in range(stop - seq.logit_rows, stop)], dtype=torch.long, device=dev)
        return StepInputs(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            batch, last,
        )

    def _start_states(self, seqs: list[Sequence], batch: AttentionBatch) -> None:
        """Each sequence's state slot for the linear layers; those computing their first token start from zero
        states (a new request, or a preempted one recomputed), those resuming a cached prefix from its snapshot
        (copied before the forward, so before any snapshot this step writes), those whose last step verified
        drafts that were rejected from its checkpoint of the last accepted one (`seq.kv.state_rollback`). The layers
        write this step's snapshots (`seq.kv.state_captures`) after the tokens that reach each boundary, and a
        verifying sequence's checkpoints after each of its drafts but the last (`DraftCheckpoints`)."""
        batch.state_slots = [seq.kv.state_slot for seq in seqs]
        fresh = [seq.kv.state_slot for seq in seqs if seq.num_cached_tokens == 0]
        base = self.state_slots + 1                                    # snapshot row r is state row base + r
        prefix_starts = [(seq.kv.state_slot, base + seq.kv.state_restore) for seq in seqs if seq.kv.state_restore >= 0]
        starts = prefix_starts + [(seq.kv.state_slot, self.draft_checkpoints.row(seq.kv.state_slot, seq.kv.state_rollback))
                                  for seq in seqs if seq.kv.state_rollback > 0]
        captures = {seq.kv.state_slot: [(position - seq.num_cached_tokens, base + row)
                                     for position, row in seq.kv.state_captures]
                    for seq in seqs if seq.kv.state_captures}
        # recurrent states also keep a checkpoint after each draft (rejected drafts roll back to one); compressed
        # caches (DeepSeek-V4) index their rings by position and need none
        checkpoints = {seq.kv.state_slot: self.draft_checkpoints.captures(seq.kv.state_slot, len(seq.drafts.token_ids))
                       for seq in seqs if seq.drafts.token_ids}
        states = [cache for cache in self.caches if isinstance(cache, LayerStateCache)]
        compressed = [cache for cache in self.caches if isinstance(cache, LayerCompressedCache)]
        compressed += self.drafter_state_caches
        if fresh:
            index = torch.tensor(fresh, dtype=torch.long, device=self.device)
            for cache in states + compressed:
                cache.clear(index)
        self._restore(states, starts)
        self._restore(compressed, prefix_starts)
        for seq in seqs:
            seq.kv.state_restore = seq.kv.state_rollback = -1
        for cache in states:
            cache.captures = {slot: captures.get(slot, []) + checkpoints.get(slot, [])
                              for slot in set(captures) | set(checkpoints)}
        for cache in compressed:
            cache.captures = captures

    def _restore(self, caches: list, starts: list[tuple[int, int]]) -> None:
        """Copy state row `row` into slot `slot` of each cache, for every (slot, row) in `starts`."""
        if not starts or not caches:
            return
        slots = torch.tensor([slot for slot, _ in starts], dtype=torch.long, device=self.device)
        rows = torch.tensor([row for _, row in starts], dtype=torch.long, device=self.device)
        for cache in caches:
            cache.restore(slots, rows)

    def _window_view(self, batch: AttentionBatch, seqs: list[Sequence], group: int) -> AttentionBatch:
        """Windowed group `group`'s slots and block tables for this step (its released blocks read as the group's
        scratch block, which every query's window masks)."""
        bs, scratch = self.block_size, self.window_blocks[group - 1]
        tables = [[block if block >= 0 else scratch for block in seq.kv.window_tables[group - 1]] for seq in seqs]
        slots = [tables[i][p // bs] * bs + p % bs for i, seq in enumerate(seqs)
                 for p in range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens)]
        width = max((len(table) for table in tables), default=1) or 1
        padded = torch.full((len(seqs), width), scratch, dtype=torch.int32, device="cpu")   # host staging
        for i, table in enumerate(tables):
            padded[i, :len(table)] = torch.tensor(table, dtype=torch.int32, device="cpu")
        return AttentionBatch(batch.query_lens, batch.context_lens, batch.query_start,
                              torch.tensor(slots, dtype=torch.long, device=self.device), padded.to(self.device),
                              batch.context_lens_tensor, bs)

    def execute(self, seqs: list[Sequence]) -> torch.Tensor:
        """Next-token logits [R, V] (fp32) of the sequences that sample this step (`samples_this_step`), in
        order, `seq.logit_rows` rows each (one; 1 + drafts when it verifies drafts); marks every sequence's
        scheduled tokens as cached."""
        return self._execute(seqs, graph_sampling=False).logits

    def execute_and_sample(self, seqs: list[Sequence],
                           sample: Callable[[torch.Tensor, list[Sequence]], SampleResult]) -> SampleResult:
        """`execute`, then the tokens of the sequences that sample: drawn inside the captured decode step when it
        runs this batch and the batch's parameters let it (`GraphSampling.refusal`: else `sample`, the engine's
        eager sampler, over the logits). The host then reads [2, B] int64 once: each row's token and status."""
        sampling = [seq for seq in seqs if seq.samples_this_step]
        in_graph = self.sample_in_graph and self.capture is not None and GraphSampling.refusal(sampling) is None
        step = self._execute(seqs, graph_sampling=in_graph)
        if not sampling:
            return SampleResult.empty()
        if step.draw is not None:
            with step_result_transfer():
                result = step.draw.to_host()
            if step.carry is not None:
                self.carry.keep(seqs, step.carry, result.token_ids)
            return result
        return sample(step.logits, sampling)

    @torch.inference_mode()
    def _execute(self, seqs: list[Sequence], graph_sampling: bool) -> ExecutedStep:
        carried = self._carried(seqs, graph_sampling)
        if carried is not None and self.capture.covers(seqs):   # routing unarmed: the kept step was captured
            return self._captured(seqs, self.capture.run_carried(seqs, carried), None)
        inputs = self.prepare(seqs)
        routing = self.arm_routing(seqs, inputs)   # routing replay: such a step runs eagerly
        captured = None if self.capture is None or routing is not None else self.capture.run(
            seqs, inputs, seqs if graph_sampling else None)
        if captured is not None:
            return self._captured(seqs, captured, inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.batch, self.caches)  # [T, H]
        self.disarm_routing(routing, seqs, inputs)
        if self.keep_hidden:   # the final hidden states, or the aux layers' inputs where an EAGLE-3 head asks
            self.last_hidden = self._kept(seqs, inputs, self.model.drafter_hidden(hidden))
        self.score_prompts(seqs, inputs, hidden)
        for seq in seqs:
            seq.commit_scheduled_tokens()
        return ExecutedStep(self.model.logits(hidden[inputs.last_token_index]))

    def _carried(self, seqs: list[Sequence], graph_sampling: bool) -> PaddedStep | None:
        """This step's inputs as the previous captured step's graph computed them, when `seqs` is that batch one
        token on, sampled in the graph, and no drafter reads its hidden states; any other step drops them
        (decode_carry.py)."""
        if self.carry is None:
            return None
        if graph_sampling and not self.keep_hidden:
            return self.carry.take(seqs)
        self.carry.drop()
        return None

    def _captured(self, seqs: list[Sequence], captured: CapturedStep, inputs: StepInputs | None) -> ExecutedStep:
        """A step the capture ran: its tokens committed, its hidden rows kept when a drafter reads them (`inputs`
        then the step's prepared ones: a carried step has none and no drafter)."""
        self.last_hidden = self._kept(seqs, inputs, captured.hidden) if self.keep_hidden else None
        for seq in seqs:
            seq.commit_scheduled_tokens()
        draw = None if captured.sampled is None else GraphSampling.draw(captured.sampled, len(seqs))
        return ExecutedStep(captured.logits, draw, captured.carry if draw is not None else None)

    def arm_routing(self, seqs: list[Sequence], inputs: StepInputs) -> StepRouting | None:
        """Arm routing replay on the model's MoE executor for this forward when a sequence of it records or
        forces its routing (moe/routing_record.py); None otherwise."""
        routing = StepRouting.for_forward(seqs, inputs.batch.query_start, self.device)
        self.model.executor.routing = routing
        return routing

    def disarm_routing(self, routing: StepRouting | None, seqs: list[Sequence], inputs: StepInputs) -> None:
        """After the forward, before its tokens are committed: each recording sequence takes its rows."""
        self.model.executor.routing = None
        if routing is not None:
            routing.hand_out(seqs, inputs.batch.query_start)

    @staticmethod
    def _kept(seqs: list[Sequence], inputs: StepInputs, hidden: torch.Tensor) -> TargetHidden:  # hidden [T, H']
        return TargetHidden(list(seqs), [seq.num_cached_tokens for seq in seqs], inputs.batch.query_start, hidden)

    def score_prompts(self, seqs: list[Sequence], inputs: StepInputs, hidden: torch.Tensor) -> None:  # hidden [T, H]
        """Prompt logprobs of the sequences whose prompt positions this forward runs (`prompt_logprobs_due`),
        from its final hidden states (before it marks their tokens cached). A prompt prefilled in chunks is
        scored chunk by chunk; `take_prompt_logprobs` hands it out once its last chunk has run."""
        for index, seq in enumerate(seqs):
            if not prompt_logprobs_due(seq):
                continue
            prompt_len = len(seq.prompt_token_ids)
            first = seq.num_cached_tokens                                  # this chunk's first position
            stop = max(min(first + seq.num_scheduled_tokens, prompt_len - 1), first)  # scores positions [first, stop)
            start = inputs.batch.query_start[index]
            part = score_prompt(self.model.logits, hidden[start : start + stop - first],          # [stop - first, H]
                                seq.prompt_token_ids[first : stop + 1], seq.params.prompt_logprobs,
                                self.prompt_logprobs_chunk_tokens)
            scored = part if first == 0 else join_prompt_logprobs(seq.partial_prompt_logprobs, part)
            if first + seq.num_scheduled_tokens < prompt_len:             # more chunks to come
                seq.partial_prompt_logprobs = scored
                continue
            seq.partial_prompt_logprobs = None
            self._scored_prompts[seq.request_id] = scored
            seq.prompt_logprobs_done = True

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        """The prompt logprobs scored since the last call, by request id (each handed out once)."""
        scored, self._scored_prompts = self._scored_prompts, {}
        return scored
