"""A model drafter (MTP) under pipeline parallelism: it lives on the last stage, every stage schedules its drafts.

The MTP layer reads the target's final hidden states, which only the last stage computes, so only the last
stage builds and runs it (`MtpDrafter.after_step` over the pipeline step's kept hidden states). Every stage's
scheduler must propose the same drafts, so after each step the last stage broadcasts the drafts it made for the
sequences that sampled ([B, k] over the pipeline's gloo control group, -1 past a sequence's last draft) and
every other stage writes them on its own copies of those sequences (`Sequence.proposed_drafts`), where
`propose` reads them next step on every stage alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_runtime.engine.sequence import Sequence
from moe_runtime.errors import InvalidRequestError
from moe_runtime.execution.step_inputs import TargetHidden
from moe_runtime.speculative.draft_source import DraftSource
from moe_runtime.speculative.mtp import MtpDrafter
from moe_runtime.speculative.mtp_loading import build_mtp_drafter


class PipelineDrafts:
    def __init__(self, drafter: MtpDrafter | None, parallel, k: int):
        """`drafter`: the last stage's (None on the others)."""
        self.drafter = drafter
        self.parallel = parallel
        self.k = k

    @classmethod
    def on_stage(cls, source: DraftSource, k: int) -> "PipelineDrafts":
        """This stage's part: the MTP drafter on the last stage, the drafts' receiver on the others."""
        parallel = source.ctx.parallel
        if parallel.world_size > parallel.pp_size:
            raise InvalidRequestError("speculative_config method 'mtp' with --pp > 1 and more than one rank per stage "
                                      "(--ep, --dp-attn, --tp, --cp) is not built: the last stage's ranks would run "
                                      "the MTP layer's exchanges without the other stages; use method 'ngram' there")
        return cls(build_mtp_drafter(source, k) if parallel.is_last_stage else None, parallel, k)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` drafts to follow `seq`: what the last stage drafted for where it stands now, if anything."""
        return seq.proposed_drafts[:k] if seq.proposed_at == seq.num_tokens else []

    def after_step(self, step: TargetHidden | None, sampled: list[Sequence]) -> None:
        if self.drafter is not None:
            self.drafter.after_step(step, sampled)
        if not sampled:
            return   # every stage sampled the same sequences: none of them broadcasts
        drafts = torch.full((len(sampled), self.k), -1, dtype=torch.int64)                   # [B, k]
        if self.drafter is not None:
            for row, seq in enumerate(sampled):
                proposed = self.propose(seq, self.k)
                drafts[row, : len(proposed)] = torch.tensor(proposed, dtype=torch.int64)
        dist.broadcast(drafts, src=self.parallel.pp_last_rank, group=self.parallel.pp_control_group)
        if self.drafter is not None:
            return
        for seq, row in zip(sampled, drafts.tolist()):
            seq.proposed_at = seq.num_tokens
            seq.proposed_drafts = [token for token in row if token >= 0]
