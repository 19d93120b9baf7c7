"""Expert selection (router top-k) for every supported MoE architecture.

One function covers Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE (softmax, optional renormalization),
DeepSeek-V2 (softmax, greedy or group-limited greedy by group max) and DeepSeek-V3 (sigmoid,
correction bias for the choice only, groups scored by their top-2 sum). The semantics reproduce
the transformers 5.24 router modules, which the tests hold this against.

gpt-oss (GptOssTopKRouter) takes the top-k of the LOGITS and a softmax over those k alone. Softmax is
monotonic, so the top-k logits are the top-k probabilities, and softmax over the chosen logits is
exp(l_i) / sum_chosen exp(l_j) = p_i / sum_chosen p_j: `scoring="softmax", renormalize=True`, the same
kind as Mixtral's (its router's bias is the Router's, moe/router.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

import torch

_SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
_GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    scoring: str = "softmax"          # "softmax" | "sigmoid" | "sqrtsoftplus" (DeepSeek-V4: sqrt(softplus(logit)))
    renormalize: bool = False         # divide the top-k weights by their sum (HF norm_topk_prob)
    num_groups: int = 1               # DeepSeek n_group (1 = no grouping)
    topk_groups: int = 1              # DeepSeek topk_group
    group_score: str = "max"          # "max" (DeepSeek-V2 group_limited_greedy) | "top2_sum" (DeepSeek-V3)
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.top_k < 1:
            raise ValueError(f"RoutingConfig.top_k must be >= 1, got {self.top_k}")
        if self.scoring not in _SCORINGS:
            raise ValueError(f"RoutingConfig.scoring must be one of {_SCORINGS}, got {self.scoring!r}")
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(f"RoutingConfig.group_score must be one of {_GROUP_SCORES}, got {self.group_score!r}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"RoutingConfig needs 1 <= topk_groups <= num_groups, got topk_groups={self.topk_groups}, "
                f"num_groups={self.num_groups}"
            )

    def validate_for(self, num_experts: int) -> None:
        """Raise a clear error when this config cannot route over `num_experts` experts."""
        if self.top_k > num_experts:
            raise ValueError(f"RoutingConfig.top_k={self.top_k} exceeds the number of experts ({num_experts})")
        if self.num_groups > 1:
            if num_experts % self.num_groups:
                raise ValueError(f"{num_experts} experts do not split into RoutingConfig.num_groups={self.num_groups}")
            group_size = num_experts // self.num_groups
            if self.topk_groups * group_size < self.top_k:
                raise ValueError(
                    f"RoutingConfig.topk_groups={self.topk_groups} groups of {group_size} experts cannot hold "
                    f"top_k={self.top_k} experts"
                )
            if self.group_score == "top2_sum" and group_size < 2:
                raise ValueError("RoutingConfig.group_score='top2_sum' needs at least 2 experts per group")


@dataclass
class TopK:
    weights: torch.Tensor   # [T, K] float32
    ids: torch.Tensor       # [T, K] int64


def group_mask(scores_for_choice: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """[T, E] bool: True for experts inside the `topk_groups` best groups of each token."""
    num_tokens, num_experts = scores_for_choice.shape
    grouped = scores_for_choice.view(num_tokens, config.num_groups, num_experts // config.num_groups)
    if config.group_score == "max":
        group_scores = grouped.max(dim=-1).values                       # [T, G]
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)       # [T, G]
    best_groups = group_scores.topk(config.topk_groups, dim=-1, sorted=False).indices  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)  # [T, G]
    return keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)


def expert_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:  # [T, E] fp32 -> [T, E]
    """Each expert's score from its router logit (what the top-k weights are gathered from)."""
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    return torch.nn.functional.softplus(logits).sqrt()


def select_experts(
    router_logits: torch.Tensor,                  # [T, E]
    config: RoutingConfig,
    correction_bias: torch.Tensor | None = None,  # [E] fp32, added to the scores for the choice only
    scores_of: Callable[[torch.Tensor, str], torch.Tensor] = expert_scores,   # (logits fp32, scoring) -> [T, E]
) -> TopK:
    """`scores_of`: how the scores are computed (the batch-invariant family passes its vector-body version)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    config.validate_for(num_experts)
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must be [{num_experts}], got shape {tuple(correction_bias.shape)}")

    scores = scores_of(router_logits.float(), config.scoring)             # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_groups > 1:
        choice = choice.masked_fill(~group_mask(choice, config), float("-inf"))
    ids = choice.topk(config.top_k, dim=-1, sorted=False).indices        # [T, K]
    return TopK(weights=chosen_weights(scores, ids, config), ids=ids)


def chosen_weights(scores: torch.Tensor, ids: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """The gating weights [T, K] of experts `ids` [T, K] from their scores [T, E] (`expert_scores`): gathered,
    renormalized and scaled as the family does; the correction bias and the groups only choose, never weigh
    (routing replay weighs forced ids with this: moe/routing_record.py)."""
    weights = scores.gather(1, ids)                                      # [T, K]
    if config.renormalize:
        denominator = weights.sum(dim=-1, keepdim=True)
        if config.scoring != "softmax":
            denominator = denominator + 1e-20
        weights = weights / denominator
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights
