"""Router top-k in one Triton program per token (softmax/sigmoid, bias, group limit, renormalize)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..routing import RoutingConfig, TopK
from ..routing import select_experts as torch_select_experts


@triton.jit
def select_experts_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    stride_logits, scaling,
    GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_PAD: tl.constexpr, SIZE_PAD: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0)
    group = tl.arange(0, GROUP_PAD)[:, None]                              # [G, 1]
    member = tl.arange(0, SIZE_PAD)[None, :]                              # [1, S]
    expert = group * GROUP_SIZE + member                                  # [G, S]
    valid = (group < NUM_GROUPS) & (member < GROUP_SIZE)
    logits = tl.load(logits_ptr + token * stride_logits + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))
        scores = shifted / tl.sum(tl.sum(shifted, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if NUM_GROUPS > 1:
        best = tl.max(choice, axis=1)                                     # [G]
        if GROUP_TOP2:
            first = tl.min(tl.where(choice == best[:, None], member, SIZE_PAD), axis=1)
            second = tl.max(tl.where(member == first[:, None], float("-inf"), choice), axis=1)
            group_score = best + second
        else:
            group_score = best
        group_ids = tl.arange(0, GROUP_PAD)
        group_score = tl.where(group_ids < NUM_GROUPS, group_score, float("-inf"))
        keep = group_ids < 0                                              # all False
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == top, group_ids, GROUP_PAD), axis=0)
            keep = keep | (group_ids == pick)
            group_score = tl.where(group_ids == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))

    slots = tl.arange(0, K_PAD)
    picked_weights = tl.zeros([K_PAD], dtype=tl.float32)
    picked_ids = tl.zeros([K_PAD], dtype=tl.int64)
    big = NUM_GROUPS * GROUP_SIZE
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, big), axis=1), axis=0)
        weight = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), axis=1), axis=0)
        picked_weights = tl.where(slots == k, weight, picked_weights)
        picked_ids = tl.where(slots == k, pick.to(tl.int64), picked_ids)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if RENORMALIZE:
        denominator = tl.sum(picked_weights, axis=0)
        if SIGMOID:
            denominator = denominator + 1e-20
        picked_weights = picked_weights / denominator
    picked_weights = picked_weights * scaling
    tl.store(weights_ptr + token * TOP_K + slots, picked_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, picked_ids, mask=slots < TOP_K)


def select_experts(router_logits: torch.Tensor, config: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> TopK:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    config.validate_for(num_experts)
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must be [{num_experts}], got shape {tuple(correction_bias.shape)}")
    if config.scoring == "sqrtsoftplus":   # DeepSeek-V4's scores: the kernel fuses softmax and sigmoid only
        return torch_select_experts(router_logits, config, correction_bias)
    weights = torch.empty(num_tokens, config.top_k, dtype=torch.float32, device=router_logits.device)  # [T, K]
    ids = torch.empty(num_tokens, config.top_k, dtype=torch.int64, device=router_logits.device)        # [T, K]
    if num_tokens == 0:
        return TopK(weights=weights, ids=ids)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    group_size = num_experts // config.num_groups
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    select_experts_kernel[(num_tokens,)](
        logits, bias, weights, ids, logits.stride(0), float(config.routed_scaling_factor),
        GROUP_SIZE=group_size, NUM_GROUPS=config.num_groups, TOPK_GROUPS=config.topk_groups,
        GROUP_PAD=triton.next_power_of_2(config.num_groups), SIZE_PAD=triton.next_power_of_2(group_size),
        TOP_K=config.top_k, K_PAD=triton.next_power_of_2(config.top_k),
        SIGMOID=config.scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
        GROUP_TOP2=config.group_score == "top2_sum", RENORMALIZE=config.renormalize,
    )
    return TopK(weights=weights, ids=ids)
