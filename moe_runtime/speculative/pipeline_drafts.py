"""A model drafter (MTP, EAGLE-3) under pipeline parallelism: it lives on the last stage, every stage schedules its
drafts.

The MTP layer reads the target's final hidden states, which only the last stage computes, so only the last
stage builds and runs it (`MtpDrafter.after_step` over the pipeline step's kept hidden states). An EAGLE-3 head
reads the inputs of three target layers, which may sit on different stages: every stage keeps those of its own
layers and hands them on beside its activations (`CausalLM.stage_activation_width`), so the last stage holds all
three and runs the head as it would the MTP layer. The drafter reads the embedding, which the last stage then
holds too (`BuildContext.embeds_on_last_stage`).

A stage of several ranks (`--ep`, `--dp-attn`: DP attention workers, attention TP) runs the drafter on each of the
last stage's ranks, each for its DP worker's sequences. The MTP layer's MoE block runs on an executor of its own
over the last stage's expert-parallel group, its weights are checked over that stage's ranks, and every rank of
the stage runs its pass and chain rows every step (`MtpDrafter`'s lock-step; an idle worker's empty step
included), so the block's exchanges pair up among the last stage's ranks alone; the other stages take no part.

Every stage's scheduler must propose the same drafts, so after each step each last-stage rank broadcasts the
drafts it made for its sequences that sampled ([B, k], -1 past a sequence's last draft) over its pipeline control
group (the gloo group of the ranks at its position on every stage, which serve the same DP worker), and the
other stages write them on their own copies of those sequences (`Sequence.drafts.proposed`), where `propose`
reads them next step on every stage alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_runtime.records.sequence import Sequence
from moe_runtime.execution.step_inputs import TargetHidden
from moe_runtime.config.speculative import SpeculativeConfig
from moe_runtime.speculative.draft_source import DraftSource
from moe_runtime.speculative.eagle3_loading import build_eagle3_drafter, keep_eagle3_aux_layers
from moe_runtime.speculative.mtp import MtpDrafter
from moe_runtime.speculative.mtp_loading import build_mtp_drafter


class PipelineDrafts:
    def __init__(self, drafter: MtpDrafter | None, parallel, k: int):
        """`drafter`: the last stage's (None on the others)."""
        self.drafter = drafter
        self.parallel = parallel
        self.k = k

    @classmethod
    def on_stage(cls, source: DraftSource, config: SpeculativeConfig) -> "PipelineDrafts":
        """This stage's part: the drafter on the last stage, the drafts' receiver on the others (which, for an
        EAGLE-3 head, keep the inputs of the aux layers they own)."""
        parallel, k = source.ctx.parallel, config.num_speculative_tokens
        if config.method == "eagle3":
            if not parallel.is_last_stage:
                keep_eagle3_aux_layers(source, config.model)
                return cls(None, parallel, k)
            return cls(build_eagle3_drafter(source, config.model, k), parallel, k)
        return cls(build_mtp_drafter(source, k) if parallel.is_last_stage else None, parallel, k)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` drafts to follow `seq`: what the last stage drafted for where it stands now, if anything."""
        return seq.drafts.proposed[:k] if seq.drafts.proposed_at == seq.num_tokens else []

    def after_step(self, step: TargetHidden | None, sampled: list[Sequence]) -> None:
        if self.drafter is not None:
            self.drafter.after_step(step, sampled)
        if not sampled:
            return   # every stage of a DP worker sampled the same sequences: none of them broadcasts
        drafts = torch.full((len(sampled), self.k), -1, dtype=torch.int64)                   # [B, k]
        if self.drafter is not None:
            for row, seq in enumerate(sampled):
                proposed = self.propose(seq, self.k)
                drafts[row, : len(proposed)] = torch.tensor(proposed, dtype=torch.int64)
        dist.broadcast(drafts, src=self.parallel.pp_last_rank, group=self.parallel.pp_control_group)
        if self.drafter is not None:
            return
        for seq, row in zip(sampled, drafts.tolist()):
            seq.drafts.proposed_at = seq.num_tokens
            seq.drafts.proposed = [token for token in row if token >= 0]
