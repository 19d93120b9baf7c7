"""Routing replay on an engine rank: which requests record or force routing, and their finished arrays.

A request asking for its routing (`SamplingParams.return_routed_experts`) or forcing one
(`forced_routed_experts`) gets a `SequenceRouting` over this rank's MoE layers; the runner fills it forward
by forward (moe/routing_record.py). Each of its `TokenDelta`s carries the rows that became final since the
previous one (`new_rows`): those of the positions [0, min(cached, tokens - 1)) not sent yet, a position being
final once its token is accepted (a verify step's rejected drafts are rolled back first), so the bytes per
step do not grow with the output and the front holds every row when it ends a request itself (a stop
string). The front joins them (front/output_processor.py). Pipeline stages hold different MoE layers: every
stage advances the same requests alike, so each delta's rows are gathered, stage by stage in layer order,
to the last stage, the one whose deltas the front reads.

Such a request never takes a prefix-cache hit for its prompt (`Scheduler._admit`): a cached prefix was not
routed by this request, so every position is computed and recorded (or forced) here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_runtime.records.sequence import Sequence
from moe_runtime.moe.layer import SparseMoE
from moe_runtime.moe.routed_experts import RoutedExpertsArray, RoutingShape
from moe_runtime.moe.routing_record import SequenceRouting
from moe_runtime.sampling.params import SamplingParams


def model_top_k(model) -> int:
    """The experts each token takes at an MoE layer of `model` (0 for a stage or model without MoE layers)."""
    return next((module.routing.top_k for module in model.modules() if isinstance(module, SparseMoE)), 0)


def wants_routing(params: SamplingParams) -> bool:
    return bool(params.return_routed_experts) or params.forced_routed_experts is not None


@dataclass(frozen=True)
class RankRouting:
    shape: RoutingShape            # the whole model's
    num_local_layers: int          # this stage's MoE layers ...
    layer_offset: int              # ... from this one on, in the model's order
    stage_layers: tuple[int, ...]  # every stage's count (one entry without pipeline parallelism)
    pp_group: object = None        # the pipeline's gloo control group (None: one stage)
    is_last_stage: bool = True

    @classmethod
    def for_engine(cls, num_local_layers: int, top_k: int, num_experts: int, parallel,
                   disaggregated: bool = False) -> "RankRouting":
        """Every stage's MoE layer count (one collective over the pipeline's stages, at startup; a stage without
        MoE layers knows no top-k or expert count: 0, the others' win). Context parallelism (a rank routes part
        of a prompt) and a P/D instance (a request's positions are computed on two instances) refuse routing
        replay at admission."""
        counts = [num_local_layers]
        if parallel.pp_size > 1:
            mine = torch.tensor([num_local_layers, top_k, num_experts], dtype=torch.int64)
            gathered = [torch.zeros_like(mine) for _ in range(parallel.pp_size)]
            dist.all_gather(gathered, mine, group=parallel.pp_control_group)
            counts = [int(part[0]) for part in gathered]
            top_k, num_experts = (int(value) for value in torch.stack(gathered).max(dim=0).values[1:])
        offset = sum(counts[: parallel.pp_rank]) if parallel.pp_size > 1 else 0
        refusal = None
        if parallel.cp_size > 1:
            refusal = "not under context parallelism (--cp), whose ranks each route a part of a prompt"
        elif disaggregated:
            refusal = "not on a prefill or decode instance (--disaggregation-mode), which computes part of a request"
        elif sum(counts) and not top_k:
            refusal = ("not for this model: its MoE layers route in transformers' own code (the transformers backend), "
                       "whose choices the engine can neither record nor force")
        return cls(RoutingShape(sum(counts), top_k, num_experts, refusal), num_local_layers, offset, tuple(counts),
                   parallel.pp_control_group if parallel.pp_size > 1 else None, parallel.is_last_stage)

    def for_request(self, params: SamplingParams) -> SequenceRouting | None:
        if not wants_routing(params):
            return None
        forced = None if params.forced_routed_experts is None else params.forced_routed_experts.to_numpy()
        return SequenceRouting(self.num_local_layers, self.shape.top_k, bool(params.return_routed_experts), forced,
                               self.layer_offset)

    def new_rows(self, seq: Sequence) -> RoutedExpertsArray | None:
        """The rows of `seq` final since its previous delta, after this step's tokens were emitted (every stage
        calls this for the same requests, in the same order); None where it did not ask, and on a stage other
        than the last."""
        if seq.routing is None or not seq.routing.record:
            return None
        rows = seq.routing.take(min(seq.num_cached_tokens, seq.num_tokens - 1))   # [n, L_stage, K]
        if self.pp_group is not None:
            rows = self._gathered(rows)
        return RoutedExpertsArray.of_ids(rows, self.shape.num_experts) if self.is_last_stage else None

    def _gathered(self, rows: torch.Tensor) -> torch.Tensor:   # [T, L_stage, K] -> [T, L, K] (all stages')
        widest = max(self.stage_layers)
        padded = torch.zeros(rows.shape[0], widest, rows.shape[2], dtype=torch.int32)
        padded[:, : rows.shape[1]] = rows
        gathered = [torch.empty_like(padded) for _ in self.stage_layers]
        dist.all_gather(gathered, padded, group=self.pp_group)
        return torch.cat([part[:, :count] for part, count in zip(gathered, self.stage_layers)], dim=1)
