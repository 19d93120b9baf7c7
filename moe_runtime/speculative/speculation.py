"""One DP worker's speculative decoding: which sequences draft, how many drafts, and what was accepted.

Drafts come from prompt lookup (`ngram`, on the host), the checkpoint's multi-token-prediction layer (`mtp`) or
an EAGLE-3 draft head (`eagle3`), the last two run after each step (`after_step`). Greedy and sampled requests draft alike: verification keeps greedy output
token for token what it is without speculation, and sampled output distributed as it is without it
(`rejection_sampling`). Requests with a grammar decode one token per step: their matcher would have to walk
the drafts before the target scores them. Rejected drafts are rolled back in every KV group and, for
recurrent-state layers, from per-draft state checkpoints (`state_rollback`). Under pipeline parallelism every
stage schedules the same drafts (prompt lookup reads the tokens every stage holds), the verify rows run through
all stages, and the last stage's accepted counts come back with its tokens (`execution/pipeline.py`); the MTP
layer or the EAGLE-3 head runs on the last stage (the head's aux layers' inputs travel there with the
activations), whose ranks broadcast their drafts to the other stages (`pipeline_drafts`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from moe_runtime.records.sequence import Sequence
from moe_runtime.errors import InvalidRequestError
from moe_runtime.execution.step_inputs import TargetHidden
from moe_runtime.config.speculative import SpeculativeConfig
from moe_runtime.speculative.draft_source import DraftSource
from moe_runtime.speculative.eagle3_loading import build_eagle3_drafter
from moe_runtime.speculative.mtp import MtpDrafter
from moe_runtime.speculative.mtp_loading import build_mtp_drafter
from moe_runtime.speculative.ngram import NgramDrafter
from moe_runtime.speculative.pipeline_drafts import PipelineDrafts

logger = logging.getLogger(__name__)


@dataclass
class SpeculationCounters:
    drafted: int = 0        # draft tokens verified by a target forward, cumulative
    accepted: int = 0       # ... of which equalled the target's own choice (emitted without a forward of their own)
    steps: int = 0          # sequence-steps that verified at least one draft


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 model_drafter: MtpDrafter | PipelineDrafts | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        self.model_drafter = model_drafter     # "mtp", "eagle3": drafts computed after each step, on the device
        self.counters = SpeculationCounters()
        self._told_grammar = False

    @classmethod
    def for_engine(cls, raw: dict | None, pp_size: int, max_model_len: int,
                   source: DraftSource | None = None) -> "Speculation | None":
        """The engine's speculation (None: off); refuses what cannot verify drafts. `source`: what a model
        drafter is built from (methods "mtp", "eagle3")."""
        config = SpeculativeConfig.parse(raw)
        if config is None:
            return None
        if config.method == "ngram":
            return cls(config, max_model_len)
        if source is None:
            raise InvalidRequestError(f"speculative_config method {config.method!r} needs the engine's model to "
                                      "draft with")
        if pp_size > 1:
            return cls(config, max_model_len, PipelineDrafts.on_stage(source, config))
        if config.method == "eagle3":
            return cls(config, max_model_len, build_eagle3_drafter(source, config.model, config.num_speculative_tokens))
        return cls(config, max_model_len, build_mtp_drafter(source, config.num_speculative_tokens))

    def local_model_drafter(self) -> MtpDrafter | None:
        """The model drafter this rank runs, with its layer and cache (under --pp the last stage's; None on the other
        stages and for n-gram)."""
        if isinstance(self.model_drafter, PipelineDrafts):
            return self.model_drafter.drafter
        return self.model_drafter

    def drafts_for(self, seq: Sequence, budget: int) -> list[int]:
        """Drafts for decoding `seq` this step: at most k, at most `budget` (tokens left in the step), none past
        its max_tokens (the verified step emits one more than it accepts) or the context length."""
        if seq.grammar is not None:
            if not self._told_grammar:
                self._told_grammar = True
                logger.info("speculative decoding: requests with structured output (a grammar) decode without "
                            "drafts")
            return []
        room = min(self.config.num_speculative_tokens, budget,
                   seq.params.max_tokens - len(seq.output_token_ids) - 1, self.max_model_len - seq.num_tokens)
        if room <= 0:
            return []
        if self.model_drafter is not None:
            return self.model_drafter.propose(seq, room)
        return self.drafter.propose(seq.all_token_ids, room)

    @staticmethod
    def after_step(speculation: "Speculation | None", step: TargetHidden | None, sampled: list[Sequence]) -> None:
        """A model drafter's turn after each target step (none when off; the n-gram drafter needs none)."""
        if speculation is not None and speculation.model_drafter is not None:
            speculation.model_drafter.after_step(step, sampled)

    def record(self, drafted: int, accepted: int) -> None:
        self.counters.drafted += drafted
        self.counters.accepted += accepted
        self.counters.steps += 1

    @staticmethod
    def stats(speculation: "Speculation | None") -> dict[str, int]:
        """WorkerStats' speculation fields (zeros when off)."""
        counters = speculation.counters if speculation is not None else SpeculationCounters()
        return {"spec_draft_tokens": counters.drafted, "spec_accepted_tokens": counters.accepted,
                "spec_verify_steps": counters.steps}
