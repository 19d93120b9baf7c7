"""Which parallel layouts a model admits; invalid ones are rejected before any process starts."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.errors import InvalidRequestError


def num_routed_experts(hf_config) -> int:
    """Routed experts per MoE layer (1 for a dense model: its MLP is the one expert)."""
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    ep: int = 1
    dp_attn: int = 1
    num_redundant_experts: int = 0

    @property
    def world_size(self) -> int:
        return self.ep

    @property
    def attn_tp(self) -> int:
        return self.ep // self.dp_attn

    def validate(self, hf_config) -> None:
        if self.ep < 1:
            raise InvalidRequestError(f"ep={self.ep}: must be >= 1")
        if self.dp_attn < 1 or self.ep % self.dp_attn:
            raise InvalidRequestError(
                f"dp_attn={self.dp_attn} must divide ep={self.ep}; valid dp_attn for ep={self.ep}: {divisors(self.ep)}"
            )
        experts = num_routed_experts(hf_config)
        slots = experts + self.num_redundant_experts
        if self.num_redundant_experts < 0:
            raise InvalidRequestError(f"num_redundant_experts={self.num_redundant_experts}: must be >= 0")
        if self.ep > 1 and experts == 1:
            raise InvalidRequestError(
                f"ep={self.ep}: this model is dense (one expert per layer), expert parallelism cannot split it; "
                f"use ep=1 (tensor/pipeline parallelism split dense models)"
            )
        if slots % self.ep:
            valid = [d for d in divisors(slots)]
            raise InvalidRequestError(
                f"ep={self.ep} does not divide the {slots} expert slots ({experts} experts + "
                f"{self.num_redundant_experts} redundant); valid ep: {valid}, or add redundant experts so "
                f"that ep divides experts + num_redundant_experts"
            )
        if self.num_redundant_experts and self.ep == 1:
            raise InvalidRequestError("num_redundant_experts needs ep > 1: replicas on one rank gain nothing")
        heads = hf_config.num_attention_heads
        if heads % self.attn_tp:
            valid_dp = [d for d in divisors(self.ep) if heads % (self.ep // d) == 0]
            raise InvalidRequestError(
                f"attention TP = ep/dp_attn = {self.attn_tp} does not divide the {heads} attention heads; "
                f"with ep={self.ep} use dp_attn in {valid_dp}"
            )
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if kv_heads % self.attn_tp and self.attn_tp % kv_heads:
            raise InvalidRequestError(
                f"attention TP = {self.attn_tp} and {kv_heads} KV heads: one must divide the other"
            )
