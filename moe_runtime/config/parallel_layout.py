"""Which parallel layouts a model admits; invalid ones are rejected before any process starts."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from moe_runtime.errors import InvalidRequestError

logger = logging.getLogger(__name__)


def num_routed_experts(hf_config) -> int:
    """Routed experts per MoE layer (1 for a dense model: its MLP is the one expert). The names transformers'
    configs use for it; DBRX keeps it in its `ffn_config` sub-config."""
    for config in (hf_config, getattr(hf_config, "ffn_config", None)):
        for name in ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value:
                return value
    return 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 if s < extra else 0) for s in range(stages))


@dataclass(frozen=True)
class ParallelLayout:
    """world = pp stages x stage_size ranks.

    A stage is the EP group of an MoE model (ep ranks), cut into dp_attn DP attention workers of
    ep / dp_attn ranks each; a worker's ranks split the heads (attention TP) and, with cp > 1, the
    tokens of each step (context parallelism): ep / dp_attn = attn_tp x cp, so cp takes ranks from
    attention TP and adds none. Without EP (dense models, or ep=1) a stage is one worker of tp x cp
    ranks.
    """

    ep: int = 1
    dp_attn: int = 1
    num_redundant_experts: int = 0
    tp: int = 1
    pp: int = 1
    pp_layers: tuple[int, ...] | None = None
    cp: int = 1

    @property
    def stage_size(self) -> int:
        return self.ep if self.ep > 1 else self.tp * self.cp  # tp > 1 only without EP

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp

    @property
    def worker_size(self) -> int:
        """Ranks of one DP attention worker (attn_tp x cp)."""
        return self.attn_tp * self.cp

    @property
    def dp_size(self) -> int:
        """DP attention workers (each with its own requests, scheduler and KV cache)."""
        return self.stage_size // self.worker_size

    @property
    def attn_tp(self) -> int:
        """Ranks splitting the heads of one DP attention worker."""
        if self.tp > 1 or self.ep == 1:
            return self.tp
        return max(self.ep // (self.dp_attn * self.cp), 1)

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.pp_layers or even_split(num_layers, self.pp)

    def validate(self, hf_config) -> None:
        for name in ("ep", "tp", "pp", "dp_attn", "cp"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.ep > 1 and self.tp > 1:
            raise InvalidRequestError(
                f"ep={self.ep} with tp={self.tp}: tp splits dense models; an MoE model splits experts with ep "
                f"and attention heads with dp_attn < ep (attention TP = ep / dp_attn)"
            )
        self._validate_pipeline(hf_config)
        if self.tp > 1:
            self._validate_tensor_parallel(hf_config)
        if self.dp_attn < 1 or self.ep % self.dp_attn:
            raise InvalidRequestError(
                f"dp_attn={self.dp_attn} must divide ep={self.ep}; valid dp_attn for ep={self.ep}: {divisors(self.ep)}"
            )
        if self.cp > 1:
            self._validate_context_parallel()
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
        if self.tp == 1 and heads % self.attn_tp:
            valid_dp = [d for d in divisors(self.ep) if heads % max(self.ep // (d * self.cp), 1) == 0]
            cp = "/cp" if self.cp > 1 else ""
            raise InvalidRequestError(
                f"attention TP = ep/dp_attn{cp} = {self.attn_tp} does not divide the {heads} attention heads; "
                f"with ep={self.ep} use dp_attn in {valid_dp}"
            )
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if kv_heads % self.attn_tp and self.attn_tp % kv_heads:
            raise InvalidRequestError(
                f"attention TP = {self.attn_tp} and {kv_heads} KV heads: one must divide the other"
            )
        if getattr(hf_config, "model_type", None) == "deepseek_v4":
            self._validate_deepseek_v4(hf_config)

    def _validate_deepseek_v4(self, hf_config) -> None:
        """What DeepSeek-V4's compressed attention does not run yet (moe_runtime/models/deepseek_v4_support.py
        refuses its engine options): context parallelism, and attention TP that would cut an output group."""
        if self.cp > 1:
            raise InvalidRequestError(f"cp={self.cp} with DeepSeek-V4: not implemented (splitting a step's tokens over "
                                      "its compressors' per-sequence state)")
        groups = hf_config.o_groups
        if self.attn_tp > 1 and groups % self.attn_tp:
            raise InvalidRequestError(
                f"attention TP = {self.attn_tp} with DeepSeek-V4's {groups} output groups (o_groups): a rank must hold "
                f"whole groups; use an attention TP that divides {groups}")

    def _validate_context_parallel(self) -> None:
        if self.ep > 1 and (self.ep // self.dp_attn) % self.cp:
            valid = [c for c in divisors(self.ep // self.dp_attn)]
            raise InvalidRequestError(
                f"cp={self.cp} must divide the {self.ep // self.dp_attn} ranks of a DP attention worker "
                f"(ep/dp_attn = {self.ep}/{self.dp_attn}): context parallelism splits a worker's ranks, it adds "
                f"none; valid cp: {valid}"
            )

    def _validate_pipeline(self, hf_config) -> None:
        layers = hf_config.num_hidden_layers
        if self.pp > layers:
            raise InvalidRequestError(f"pp={self.pp} exceeds the model's {layers} layers; use pp <= {layers}")
        if self.pp_layers is not None:
            if len(self.pp_layers) != self.pp or sum(self.pp_layers) != layers or min(self.pp_layers) < 1:
                raise InvalidRequestError(
                    f"pp_layers={list(self.pp_layers)} must give {self.pp} stages of >= 1 layer summing to the "
                    f"model's {layers} layers (e.g. {list(even_split(layers, self.pp))})"
                )

    def _validate_tensor_parallel(self, hf_config) -> None:
        if num_routed_experts(hf_config) > 1:
            raise InvalidRequestError(
                f"tp={self.tp}: tensor parallelism is for dense models; this MoE model uses ep (experts) and "
                f"dp_attn (attention TP = ep / dp_attn)"
            )
        heads = hf_config.num_attention_heads
        if heads % self.tp:
            valid = [d for d in divisors(heads)]
            raise InvalidRequestError(f"tp={self.tp} does not divide the {heads} attention heads; valid tp: {valid}")
        inter = hf_config.intermediate_size
        if inter % self.tp:
            raise InvalidRequestError(f"tp={self.tp} does not divide intermediate_size={inter}; valid tp: "
                                      f"{[d for d in divisors(heads) if inter % d == 0]}")
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if kv_heads % self.tp and self.tp % kv_heads:
            raise InvalidRequestError(f"tp={self.tp} and {kv_heads} KV heads: one must divide the other")
        if self.kv_replication(hf_config) > 1:
            logger.warning("tp=%d > %d KV heads: each KV head is replicated on %d ranks, so the job's KV cache "
                           "holds %dx the bytes of an unreplicated one", self.tp, kv_heads,
                           self.kv_replication(hf_config), self.kv_replication(hf_config))

    def kv_replication(self, hf_config) -> int:
        """How many ranks hold a copy of each KV head (1 = no replication)."""
        tp = self.attn_tp
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        return tp // kv_heads if tp > kv_heads else 1
