"""One forward step of a pipeline stage, in micro-batches so that stages overlap.

Every stage of a DP worker holds the same scheduler state, so each knows the batch and its split
into micro-batches without being told. Stage s receives micro-batch i's activations from stage
s-1, runs its layers, and sends them on without waiting, then takes micro-batch i+1: while stage
s+1 works on micro-batch i, stage s already works on i+1. The last stage computes the logits and
samples; the sampled tokens are broadcast back along the pipeline so every stage advances its
sequences identically. With speculative decoding a verifying sequence runs its last token and its d drafts
through every stage (1 + d rows, each stage writing its own layers' K/V and recurrent states), the last stage
scores all 1 + d rows and accepts, and the broadcast carries how many drafts each sequence accepted beside its
token: every stage then appends the same tokens and rolls back the same rejected drafts in its own cache. The
number of micro-batches is the same on every rank of a stage (empty ones included), because the MoE layers'
collectives inside a stage must pair up. A model drafter on the last stage reads the step's hidden states
(`StageHidden`); for an EAGLE-3 head each stage hands on, beside the residual stream, the inputs of the head's aux
layers that it and the stages before it own (`CausalLM.stage_activation_width`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_runtime.records.sequence import Sequence
from moe_runtime.execution.step_inputs import TargetHidden
from moe_runtime.sampling.device_draw import SampleResult


@dataclass
class PipelineStepResult:
    logits: torch.Tensor | None    # [B, V] on the last stage, else None
    compute_seconds: float         # time this stage spent running its layers (the rest is bubble or comms)


@dataclass
class StageHidden:
    """The last stage's final hidden states of one step (an EAGLE-3 head: its aux layers' inputs, which earlier
    stages handed on with their activations), gathered micro-batch by micro-batch for a model drafter."""

    seqs: list[Sequence]
    starts: list[int]                                   # [B] each sequence's first position this step
    query_start: list[int]                              # [B + 1] over the whole step
    parts: list[torch.Tensor]                           # each micro-batch's [t, H] (EAGLE-3: [t, 3H]), in order

    @classmethod
    def before(cls, seqs: list[Sequence]) -> "StageHidden":
        """Where each sequence stands before the step commits its tokens."""
        query_start = [0]
        for seq in seqs:
            query_start.append(query_start[-1] + seq.num_scheduled_tokens)
        return cls(list(seqs), [seq.num_cached_tokens for seq in seqs], query_start, [])

    def step(self) -> TargetHidden:
        return TargetHidden(self.seqs, self.starts, self.query_start, torch.cat(self.parts))


def split_micro_batches(seqs: list[Sequence], count: int) -> list[list[Sequence]]:
    """`count` contiguous groups of sequences, as equal as possible (some may be empty)."""
    size, extra = divmod(len(seqs), count)
    groups, start = [], 0
    for i in range(count):
        stop = start + size + (1 if i < extra else 0)
        groups.append(seqs[start:stop])
        start = stop
    return groups


@torch.inference_mode()
def run_pipeline_step(runner, seqs: list[Sequence], parallel, num_micro_batches: int) -> PipelineStepResult:
    model = runner.model
    hidden_size = model.stage_activation_width()
    sends, logits, compute = [], [], 0.0
    kept = StageHidden.before(seqs) if runner.keep_hidden and parallel.is_last_stage else None
    for group in split_micro_batches(seqs, num_micro_batches):
        inputs = runner.prepare(group)
        num_tokens = inputs.input_ids.shape[0]
        hidden = None
        if not parallel.is_first_stage and num_tokens:
            hidden = torch.empty(num_tokens, hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(hidden, parallel.pp_prev_rank, group=parallel.pp_group)
        elif not parallel.is_first_stage:
            hidden = torch.empty(0, hidden_size, dtype=runner.dtype, device=runner.device)
        started = time.perf_counter()
        routing = runner.arm_routing(group, inputs)   # routing replay: this stage's MoE layers
        out = model(inputs.input_ids, inputs.positions, inputs.batch, runner.caches, hidden)
        runner.disarm_routing(routing, group, inputs)
        compute += time.perf_counter() - started
        if not parallel.is_last_stage:
            if num_tokens:
                sends.append(dist.isend(out.contiguous(), parallel.pp_next_rank, group=parallel.pp_group))
        else:
            if group:
                runner.score_prompts(group, inputs, out)   # final hidden states exist on the last stage only
                logits.append(model.logits(out[inputs.last_token_index]))
            if kept is not None:   # empty micro-batches too: a drafter in lock-step runs on an empty step
                kept.parts.append(model.drafter_hidden(out))
    for request in sends:
        request.wait()
    if kept is not None:   # a model drafter reads them (`speculative/pipeline_drafts.py`)
        runner.last_hidden = kept.step()
    for seq in seqs:
        seq.commit_scheduled_tokens()
    return PipelineStepResult(torch.cat(logits) if logits else None, compute)


def broadcast_step_result(sampled: SampleResult | None, seqs: list[Sequence], parallel) -> SampleResult:
    """The last stage's result for `seqs` (those that sample), on every stage of the pipeline group: each
    sequence's token and how many of its drafts were accepted (a CPU [2, B] tensor: the pipeline's gloo control
    group). The other stages know the drafts themselves; logprobs stay on the last stage, which reports them."""
    if sampled is not None:
        rows = [sampled.token_ids, [len(accepted) for accepted in sampled.accepted_rows()]]
    else:
        rows = [[0] * len(seqs), [0] * len(seqs)]
    buffer = torch.tensor(rows, dtype=torch.int64)                                  # [2, B]
    dist.broadcast(buffer, src=parallel.pp_last_rank, group=parallel.pp_control_group)
    if sampled is not None:
        return sampled
    tokens, accepted = buffer.tolist()
    errors = ["sampling failed on the last pipeline stage" if t == SampleResult.NO_TOKEN else None for t in tokens]
    return SampleResult(tokens, [None] * len(seqs), errors,
                        [[(draft, None) for draft in seq.drafts.token_ids[:n]] for seq, n in zip(seqs, accepted)])
