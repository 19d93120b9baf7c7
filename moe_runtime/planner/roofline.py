"""Step time of one instance under a layout: per layer max(compute, memory) + communication, and the bubble.

Per layer and rank, a step's time is the larger of its FLOPs over the sustained FLOP/s and the bytes it must
read (its weight share, the experts its batch touches, the K/V its queries read) over the sustained HBM
bandwidth, never under a fixed floor (launches, norms, routing), plus what it waits for on the wire:
  - tensor parallelism: two all-reduces of the activations per layer (after attention and after the MLP);
    attention TP inside an MoE DP worker one (after attention; the experts' combine returns the rest),
  - expert parallelism: two all-to-alls per MoE layer (dispatch and combine), each rank sending its tokens'
    top_k copies of the hidden state, (ep - 1) / ep of them off-rank,
  - context parallelism: every layer's new K/V gathered over the cp ranks,
  - pipeline parallelism: a step runs m micro-batches through pp stages, (m + pp - 1) stage slots of which
    pp - 1 are the bubble, and the activations hop between stages.
A group wider than a node runs at the NIC's bandwidth. Routing is never perfectly even: the busiest EP rank
gets `ROUTING_SKEW` times the mean expert load, which redundant expert slots (EPLB replicas of the hot experts)
take back in proportion (one redundant slot per rank: even). That factor is an assumption, not a measurement.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.hardware import Hardware
from moe_runtime.planner.memory import Precision, grouped_full, kv_bytes_per_token
from moe_runtime.planner.model_shape import LINEAR, LayerShape, ModelShape

ROUTING_SKEW = 1.25   # busiest EP rank's expert load over the mean, without replicas


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int

    def crosses(self, group_size: int) -> bool:
        return group_size > self.gpus_per_node


@dataclass(frozen=True)
class StepModel:
    """What one instance's step costs: built once per layout, asked for many batch sizes."""

    shape: ModelShape
    layout: ParallelLayout
    precision: Precision
    hardware: Hardware
    topology: Topology
    micro_batches: int = 0        # --pp-micro-batches (0 = pp)

    def stage_kinds(self) -> list[Counter]:
        """Per pipeline stage: each distinct (layer, in the full group) with how many times it occurs."""
        in_full = grouped_full(self.shape)
        kinds, first = [], 0
        for count in self.layout.stage_layers(self.shape.num_layers):
            kinds.append(Counter(zip(self.shape.layers[first:first + count], in_full[first:first + count])))
            first += count
        return kinds

    def step_seconds(self, tokens: int, context: float, decode: bool, kinds: list[Counter] | None = None) -> float:
        """One step of `tokens` new tokens per DP worker (each reading `context` cached tokens on average)."""
        kinds = kinds or self.stage_kinds()
        m = self.micro_batches or self.layout.pp
        m = max(min(m, tokens), 1) if self.layout.pp > 1 else 1
        per_micro = tokens / m
        stage_times = [self._stage_seconds(kind, per_micro, context, decode, last=i == len(kinds) - 1)
                       for i, kind in enumerate(kinds)]
        pp = self.layout.pp
        hop = 0.0
        if pp > 1:
            crosses = self.topology.crosses(self.layout.world_size)
            hop = (per_micro * self.shape.hidden_size * self.precision.compute_bytes
                   / self.hardware.link_bytes_s(crosses) + self.hardware.latency_s(crosses))
        slots = m + pp - 1
        return slots * (max(stage_times) + hop) + self._step_overhead(tokens)

    def _step_overhead(self, tokens: int) -> float:
        """A step's host work: a GPU's flat figure; on a CPU the measured rest of a step (sampling, scheduling,
        embedding) and, with several ranks, what the front and the lock-step loop add to the workers' forward."""
        cpu = self.hardware.cpu
        if cpu is None:
            return self.hardware.step_overhead_s
        return cpu.rest.at(tokens) + (cpu.control_s if self.layout.world_size > 1 else 0.0)

    def bubble(self, tokens: int) -> float:
        m = self.micro_batches or self.layout.pp
        m = max(min(m, tokens), 1) if self.layout.pp > 1 else 1
        return (self.layout.pp - 1) / (m + self.layout.pp - 1)

    def _stage_seconds(self, kinds: Counter, tokens: float, context: float, decode: bool, last: bool) -> float:
        total = sum(n * self._layer_seconds(layer, full, tokens, context, decode) for (layer, full), n in kinds.items())
        if last:
            total += self._lm_head_seconds(tokens if decode else tokens_sampled(tokens))
        return total

    def _layer_seconds(self, layer: LayerShape, full: bool, tokens: float, context: float, decode: bool) -> float:
        compute, memory, comm = self.layer_parts(layer, full, tokens, context, decode)
        cpu = self.hardware.cpu
        if cpu is None:
            return max(compute, memory, self.hardware.layer_overhead_s) + comm
        # CPU: each part's roofline plus its measured framework cost, and what the job's other ranks add (comm)
        attention, mlp = self.part_rooflines(layer, full, tokens, context, decode)
        rank_tokens = tokens / self.layout.cp
        fixed = cpu.attention.at(rank_tokens) + (cpu.moe.at(self.touched_experts(tokens)) if layer.moe
                                                 else cpu.dense.at(rank_tokens) if layer.dense_params else 0.0)
        return attention + mlp + fixed + comm

    def part_rooflines(self, layer: LayerShape, full: bool, tokens: float, context: float,
                       decode: bool) -> tuple[float, float]:
        """max(compute, memory) seconds of the layer's attention and of its MLP (MoE or dense), apart."""
        attention = replace(layer, dense_params=0, shared_params=0, expert_params=0, router_params=0)
        mlp = replace(layer, attention_params=0, span=LINEAR, window=None, state_fp32=0, state_conv=0)
        a = self.layer_parts(attention, full, tokens, context, decode)
        b = self.layer_parts(mlp, full, tokens, context, decode)
        return max(a[0], a[1]), max(b[0], b[1])

    def touched_experts(self, tokens: float) -> float:
        """Expert slots the busiest EP rank runs in a step: each slot is touched unless no token picks it."""
        lo, shape = self.layout, self.shape
        group_tokens = tokens * lo.dp_size
        slots = (shape.num_experts + lo.num_redundant_experts) / max(lo.ep, 1)
        return slots * (1 - (1 - shape.top_k / shape.num_experts) ** max(group_tokens, 0))

    def breakdown(self, tokens: int, context: float) -> dict[str, float]:
        """A decode step's seconds by what bounds them, summed over the layers of every stage (no bubble)."""
        parts = {"compute": 0.0, "memory": 0.0, "communication": 0.0}
        for kinds in self.stage_kinds():
            for (layer, full), n in kinds.items():
                compute, memory, comm = self.layer_parts(layer, full, tokens, context, True)
                parts["compute"] += n * compute
                parts["memory"] += n * memory
                parts["communication"] += n * comm
        return parts

    def layer_parts(self, layer: LayerShape, full: bool, tokens: float, context: float,
                    decode: bool) -> tuple[float, float, float]:
        """(compute, memory, communication) seconds of one layer on the busiest rank."""
        hw, lo, p = self.hardware, self.layout, self.precision
        attn_tp, cp = lo.attn_tp, lo.cp
        dense_split = attn_tp if lo.tp > 1 else 1
        dt = p.compute_bytes
        rank_tokens = tokens / cp
        flops = 2 * rank_tokens * (layer.attention_params / attn_tp + (layer.dense_params + layer.shared_params)
                                   / dense_split + layer.router_params)
        bytes_ = (layer.attention_params / attn_tp + (layer.dense_params + layer.shared_params) / dense_split) \
            * p.linear_bytes + layer.router_params * dt
        if layer.span != LINEAR:
            reach = context if full or layer.window is None else min(context, layer.window)
            if not decode:
                reach = reach + min(tokens, layer.window or tokens) / 2
            heads = max(self.shape.num_heads // attn_tp, 1)
            per_key = layer.kv_dim if layer.kv_split else 2 * layer.kv_dim   # GQA: K and V; MLA: absorbed latent twice
            flops += 2 * rank_tokens * heads * per_key * reach
            bytes_ += (tokens if decode else 1) * reach * kv_bytes_per_token(layer, attn_tp, dt) / (cp if not decode else 1)
        else:   # a linear-attention layer reads and writes its fixed state once per sequence
            bytes_ += tokens * (layer.state_fp32 * 4 + layer.state_conv * dt) / attn_tp * (2 if decode else 0)
        comm = 0.0
        if layer.moe:
            expert_flops, expert_bytes = self._experts(layer, tokens)
            flops += expert_flops
            bytes_ += expert_bytes
            comm += self._all_to_alls(tokens)
        if attn_tp > 1:
            reduces = 2 if lo.tp > 1 else 1
            comm += reduces * self._all_reduce(rank_tokens * self.shape.hidden_size * dt, attn_tp)
        if cp > 1 and layer.span != LINEAR:
            comm += self._all_gather(tokens * kv_bytes_per_token(layer, attn_tp, dt), cp)
        return flops / hw.flops(dt, fp8_weights=False), bytes_ / (hw.hbm_bytes_s * hw.mem_efficiency), comm

    def _experts(self, layer: LayerShape, tokens: float) -> tuple[float, float]:
        """(FLOPs, bytes) of the busiest rank's experts: the EP group's tokens from every DP worker, top_k each."""
        lo, shape = self.layout, self.shape
        ep = max(lo.ep, 1)
        group_tokens = tokens * lo.dp_size
        pairs = group_tokens * shape.top_k / ep * skew(lo)
        return 2 * pairs * layer.expert_params, self.touched_experts(tokens) * layer.expert_params * self.precision.expert_bytes

    def _all_to_alls(self, tokens: float) -> float:
        lo = self.layout
        if lo.ep <= 1:
            return 0.0
        crosses = self.topology.crosses(lo.ep)
        sent = self.all_to_all_bytes(tokens)
        cpu = self.hardware.cpu
        if cpu is not None:   # measured per MoE layer in a running expert-parallel job of this machine
            return cpu.expert_parallel.at(sent)
        one = sent / self.hardware.link_bytes_s(crosses) + self.hardware.latency_s(crosses)
        return 2 * one

    def all_to_all_bytes(self, tokens: float) -> float:
        """Bytes a rank sends off-rank per all-to-all: its tokens' top_k copies of the hidden state, (ep - 1) / ep."""
        lo = self.layout
        sent = tokens / lo.worker_size * self.shape.top_k * self.shape.hidden_size * self.precision.compute_bytes
        return sent * (lo.ep - 1) / lo.ep

    def _all_reduce(self, nbytes: float, ranks: int) -> float:
        crosses = self.topology.crosses(ranks)
        cpu = self.hardware.cpu
        if cpu is not None:   # measured per all-reduce in a running tensor-parallel job of this machine
            return (ranks - 1) * cpu.all_reduce.at(nbytes)
        return (2 * (ranks - 1) / ranks * nbytes / self.hardware.link_bytes_s(crosses)
                + self.hardware.latency_s(crosses))

    def _all_gather(self, nbytes: float, ranks: int) -> float:
        crosses = self.topology.crosses(ranks * self.layout.attn_tp)
        return (ranks - 1) / ranks * nbytes / self.hardware.link_bytes_s(crosses) + self.hardware.latency_s(crosses)

    def _lm_head_seconds(self, rows: float) -> float:
        hw, p = self.hardware, self.precision
        split = self.layout.attn_tp if self.layout.tp > 1 else 1
        params = self.shape.vocab_size * self.shape.hidden_size / split
        compute = 2 * rows * params / hw.flops(p.compute_bytes, fp8_weights=False)
        memory = params * p.compute_bytes / (hw.hbm_bytes_s * hw.mem_efficiency)
        return max(compute, memory)


def tokens_sampled(prefill_tokens: float) -> float:
    """A prefill step samples one row per sequence, not per token (the LM head's rows)."""
    return 1.0 if prefill_tokens else 0.0


def skew(layout: ParallelLayout) -> float:
    """The busiest EP rank's expert load over the mean: ROUTING_SKEW, taken back by redundant slots."""
    if layout.ep <= 1:
        return 1.0
    covered = min(layout.num_redundant_experts / layout.ep, 1.0)
    return 1 + (ROUTING_SKEW - 1) * (1 - covered)
