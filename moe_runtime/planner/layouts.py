"""Every layout the runtime can run for a model on up to N GPUs, and why the others cannot, in one line.

The runtime's own `ParallelLayout.validate` decides what a layout admits (heads, experts, stages), so the
planner never proposes what `moe-serve` would refuse; the planner adds the refusals that need the
hardware (weights that do not fit, KV that cannot hold one request) and the KV cache groups' (a model with
windowed layers beside full ones runs neither context parallelism nor P/D transfer yet).

Layouts: dense models tp x cp x pp; MoE models ep (attention TP = ep / dp_attn / cp inside each DP worker) x
pp, with redundant expert slots where they help (the fewest that make ep divide the slots, and one more per
rank for EPLB's replicas). World sizes are the powers of two and the divisors of the GPUs given.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from moe_runtime.config.parallel_layout import ParallelLayout, divisors
from moe_runtime.errors import InvalidRequestError
from moe_runtime.planner.model_shape import FULL, LINEAR, ModelShape

CP_MIN_PROMPT = 4096   # context parallelism is for long prompts; shorter ones only pay its K/V exchange


@dataclass(frozen=True)
class Candidate:
    layout: ParallelLayout
    reason: str | None = None      # why it cannot run (None: it can, as far as the layout goes)

    @property
    def name(self) -> str:
        lo = self.layout
        parts = []
        if lo.ep > 1:
            parts.append(f"ep{lo.ep}")
            parts.append(f"dp_attn{lo.dp_attn}" + (f"(attn_tp{lo.attn_tp})" if lo.attn_tp > 1 else ""))
        if lo.tp > 1:
            parts.append(f"tp{lo.tp}")
        if lo.cp > 1:
            parts.append(f"cp{lo.cp}")
        if lo.pp > 1:
            parts.append(f"pp{lo.pp}")
        if lo.num_redundant_experts:
            parts.append(f"+{lo.num_redundant_experts}red")
        return " ".join(parts) or "1 rank"


def world_sizes(total: int) -> list[int]:
    sizes = {d for d in divisors(total)}
    power = 1
    while power <= total:
        sizes.add(power)
        power *= 2
    return sorted(sizes)


def enumerate_layouts(shape: ModelShape, total_gpus: int, prompt_len: int) -> list[Candidate]:
    """Every layout of up to `total_gpus` ranks, each checked by the runtime's rules."""
    cps = [1] + ([2, 4, 8] if prompt_len >= CP_MIN_PROMPT else [])
    layouts = []
    for world in world_sizes(total_gpus):
        for pp in divisors(world):
            if pp > shape.num_layers:
                continue
            stage = world // pp
            if shape.is_moe:
                layouts += _moe_layouts(shape, stage, pp, cps)
            else:
                for cp in cps:
                    if stage % cp == 0:
                        layouts.append(ParallelLayout(tp=stage // cp, pp=pp, cp=cp))
    return [check(shape, layout) for layout in dict.fromkeys(layouts)]


def _moe_layouts(shape: ModelShape, ep: int, pp: int, cps: list[int]) -> list[ParallelLayout]:
    if ep == 1:
        return [ParallelLayout(pp=pp)]
    out = []
    least = -shape.num_experts % ep
    for dp_attn in divisors(ep):
        for cp in cps:
            if (ep // dp_attn) % cp:
                continue
            for redundant in sorted({least, least + ep}):
                out.append(ParallelLayout(ep=ep, dp_attn=dp_attn, num_redundant_experts=redundant, pp=pp, cp=cp))
    return out


def check(shape: ModelShape, layout: ParallelLayout) -> Candidate:
    """The runtime's verdict on `layout` (its first refusal, as one line), plus the KV cache groups' rule."""
    quiet = logging.getLogger("moe_runtime.config.parallel_layout")
    level = quiet.level
    quiet.setLevel(logging.ERROR)   # the KV replication warning is the planner's to weigh, not to print
    try:
        layout.validate(shape.hf_namespace())
    except InvalidRequestError as exc:
        return Candidate(layout, str(exc).splitlines()[0])
    finally:
        quiet.setLevel(level)
    if layout.cp > 1 and hybrid_kv_groups(shape):
        return Candidate(layout, f"cp={layout.cp}: windowed KV cache groups beside full layers do not run "
                                 "context parallelism yet")
    return Candidate(layout)


def hybrid_kv_groups(shape: ModelShape) -> bool:
    """Whether windowed layers keep groups of their own beside full ones (KVGroups.of_layers)."""
    spans = [l.span for l in shape.layers if l.span != LINEAR]
    return any(s != FULL for s in spans) and any(s == FULL for s in spans)
