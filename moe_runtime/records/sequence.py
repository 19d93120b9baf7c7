"""One request's state inside a DP worker: tokens, KV blocks, sampling state (seeded generator, grammar)."""
from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from moe_runtime.moe.routing_record import SequenceRouting
from moe_runtime.records.sequence_kv import SequenceKV
from moe_runtime.sampling.logprobs import PromptLogprobs, TokenLogprob
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.structured_output.grammar_state import GrammarState



class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"     # the engine (or the front) could not advance this request alone


@dataclass
class DraftState:
    """A request's speculative decoding state: speculative/ writes it, the scheduler and the runner read it."""
    token_ids: list[int] = field(default_factory=list)   # this step's drafts after its last token
    proposed: list[int] = field(default_factory=list)    # a model drafter's drafts (MTP) for its next step ...
    proposed_at: int = -1                                # ... valid while num_tokens is this


@dataclass
class Sequence:
    """One request on one rank. Each field has one stage that writes it (others read it):

    - set once at admission (engine/core.py): the request, its params and seed, `export_kv`, `routing`;
    - the scheduler (engine/scheduler.py): `status`, `finish_reason`, `num_scheduled_tokens`, `num_preemptions`,
      the output tokens and logprobs (`Scheduler.advance`); the core times the queue (`queue_*`);
    - the block manager (kv_blocks/): `kv`, where its KV lives (`SequenceKV`: block tables, the recurrent-state
      slot and its rows, block hashes, tier loads), and `num_cached_tokens` (a decode instance's import sets it,
      each step commits its scheduled tokens into it: the request's progress, which its properties below read);
    - speculation (speculative/): `drafts`;
    - the model runner (execution/): prompt scoring (`partial_prompt_logprobs`, `prompt_logprobs_done`);
    - structured output: `grammar`, attached once compiled.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int                                   # admission order, for FCFS and preemption choice
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    kv: SequenceKV = field(default_factory=SequenceKV)    # where its KV lives (kv_blocks/ writes it)
    num_cached_tokens: int = 0                     # tokens whose K/V are in the cache
    num_scheduled_tokens: int = 0                  # tokens the current step computes (a prefill chunk, 1, or 1 + drafts)
    drafts: DraftState = field(default_factory=DraftState)   # speculation's (speculative/ writes it)
    partial_prompt_logprobs: PromptLogprobs | None = None  # chunked prefill: the prompt scored so far
    num_preemptions: int = 0
    sampling_seed: int = -1                        # what keys its random draws (the request's seed, else a fresh one)
    grammar: GrammarState | None = None            # structured output: where the output is in its grammar
    prompt_logprobs_done: bool = False             # scored once: a preempted request's recompute does not again
    export_kv: bool = False                        # prefill instance: park its blocks after its first token
    queued_at: float = 0.0                         # perf_counter when it arrived here (its queue time's start)
    queue_seconds: float | None = None             # arrival to first scheduled step, once known
    queue_reported: bool = False                   # ... and handed out in a delta
    routing: SequenceRouting | None = None         # routing replay: its record / forced ids (return_routed_experts,
                                                   # forced_routed_experts), on this rank's MoE layers

    def __post_init__(self) -> None:
        if self.sampling_seed < 0:
            self.sampling_seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)

    @property
    def parked(self) -> bool:
        """A prefill instance's request done here whose blocks wait for a decode instance (a model drafter still
        runs over its last rows: they travel with the blocks, `disaggregation/draft_layer.py`)."""
        return self.export_kv and self.finish_reason == FinishReason.LENGTH

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def tokens_to_compute(self) -> int:
        """Tokens not in the cache yet (the whole uncached suffix; a step may compute a chunk of it)."""
        return self.num_tokens - self.num_cached_tokens

    @property
    def is_decoding(self) -> bool:
        """Past its prompt: each step computes the one token it sampled last."""
        return bool(self.output_token_ids) and self.num_cached_tokens == self.num_tokens - 1

    @property
    def samples_this_step(self) -> bool:
        """The scheduled tokens reach its last token: this step's logits give its next token (a prefill
        chunk that stops short of the end samples nothing)."""
        return self.num_cached_tokens + self.num_scheduled_tokens == self.num_tokens + len(self.drafts.token_ids)

    @property
    def logit_rows(self) -> int:
        """Logits rows it needs when it samples: its last token's, and one per draft (each verifies the next)."""
        return 1 + len(self.drafts.token_ids)

    def scheduled_token_ids(self) -> list[int]:
        """The tokens this step computes: uncomputed ones, then the drafts."""
        start = self.num_cached_tokens
        tokens = self.all_token_ids[start : start + self.num_scheduled_tokens]
        return tokens + self.drafts.token_ids[: self.num_scheduled_tokens - len(tokens)]

    def commit_scheduled_tokens(self) -> None:
        """The step ran: its scheduled tokens are in the cache now."""
        self.num_cached_tokens += self.num_scheduled_tokens
        self.num_scheduled_tokens = 0
