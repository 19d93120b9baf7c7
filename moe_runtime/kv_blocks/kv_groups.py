"""KV cache groups: layers that keep every token's K/V, and layers that need only a window of them.

A model declares each attention layer's span (`AttentionSpan`): full (every earlier token), a sliding window
of W tokens (Mistral, Qwen2's upper layers, gpt-oss's alternate layers) or a chunk of C tokens (Llama 4's
local layers). Layers of one span form a group; the full group (group 0) keeps the paged cache as before:
its block table drives admission, preemption and prefix caching. Each windowed group keeps a block table of
its own over a pool of its own, in which only the blocks a step can still read are held: blocks that fell
out of every future query's reach go back to the pool, so a sequence holds at most ceil(W / block_size) + 1
of them whatever its length (vLLM's hybrid KV cache manager keeps the same bound). Positions whose blocks
are gone point at the pool's scratch block: no query reads them (its mask forbids), and every read stays
inside the cache.

DeepSeek Sparse Attention's index keys (one per token, every token) need no group of their own: they are a sparse
layer's second cache tensor, in the full group's blocks (moe_runtime/layers/sparse_mla.py).

A windowed pool needs no admission control: it is sized for the worst step, every running sequence holding
its window plus the step's new tokens (`window_pool_blocks`), so a windowed block is always there when a
scheduled step asks for it, and the full group alone decides what fits.

Prefix caching: a windowed group registers its full blocks under the same prefix hashes as the full group,
and a block leaving the window stays cached (idle, evictable) rather than free. A cached prefix is reused as
far as every windowed group still holds the window its first new query reads (vLLM's rule too): recomputing
only that window would not do, since a windowed layer's K/V at a position depends, through the layers below
it, on tokens far behind its own window.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.layers.attention_span import AttentionSpan
from moe_runtime.config.speculative import SpeculativeConfig

@dataclass(frozen=True)
class KVGroup:
    span: AttentionSpan
    layers: tuple[int, ...]         # model layer indices


@dataclass(frozen=True)
class KVGroups:
    """The model's groups: group 0 holds the full layers (or every layer when none is windowed, or when no
    layer is full: a model without full layers keeps today's one table, its windows applied by the masks)."""

    groups: tuple[KVGroup, ...]

    @classmethod
    def of_layers(cls, spans: list[AttentionSpan]) -> "KVGroups":
        full = tuple(i for i, span in enumerate(spans) if not span.windowed)
        if not full or len(full) == len(spans):
            return cls((KVGroup(AttentionSpan(), tuple(range(len(spans)))),))
        windows: dict[AttentionSpan, list[int]] = {}
        for i, span in enumerate(spans):
            if span.windowed:
                windows.setdefault(span, []).append(i)
        return cls((KVGroup(AttentionSpan(), full), *(KVGroup(s, tuple(ls)) for s, ls in windows.items())))

    @classmethod
    def single(cls) -> "KVGroups":
        """One group for every layer (what a model without windowed layers beside full ones has)."""
        return cls((KVGroup(AttentionSpan(), ()),))

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windowed(self) -> tuple[KVGroup, ...]:
        return self.groups[1:]

    def group_of_span(self, span: AttentionSpan) -> int:
        """The group a layer of `span` caches in (group 0 unless a windowed group has that span)."""
        for index, group in enumerate(self.groups):
            if index and group.span == span:
                return index
        return 0


def window_pool_blocks(span: AttentionSpan, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a windowed group's pool needs so that no step ever waits for one: every running sequence holds
    the blocks its next query reads (at most ceil(size / block_size) + 1), and a step adds its new tokens'
    (at most ceil(n / block_size) + 1 for n tokens of one sequence, n summing to the step's token budget)."""
    per_sequence = -(-span.max_span() // block_size) + 2
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size)


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's KV cache groups, each windowed group's pool size (`window_blocks[i]` for group i + 1), and the
    recurrent-state slots of its linear-attention layers (0: none; moe_runtime/kv_blocks/state_slots.py)."""

    groups: KVGroups
    window_blocks: tuple[int, ...] = ()
    state_slots: int = 0
    drafter_layers: int = 0        # full-group layers a drafter adds (the MTP layer), paid from the same budget
    draft_checkpoints: int = 0     # state rows per slot for the states inside a verify step (speculation's k)

    @classmethod
    def single(cls) -> "KVCacheLayout":
        return cls(KVGroups.single())

    @classmethod
    def plan(cls, spans: list[AttentionSpan], config: EngineConfig,
             state_layers: tuple[int, ...] = ()) -> "KVCacheLayout":
        """The layout of a model whose layers have `spans` (and `state_layers` keeping recurrent states), under
        `config` (which is refused, naming the flag, where windowed groups or state slots are not supported yet)."""
        drafter_layers = SpeculativeConfig.drafter_kv_layers(config.speculative_config)
        if state_layers:
            speculation = SpeculativeConfig.parse(config.speculative_config)
            return cls(KVGroups.single(), state_slots=_state_slots(config, state_layers), drafter_layers=drafter_layers,
                       draft_checkpoints=speculation.num_speculative_tokens if speculation is not None else 0)
        groups = KVGroups.of_layers(spans)
        if not groups.hybrid:
            return cls(groups, drafter_layers=drafter_layers)
        kinds = ", ".join(sorted({f"{g.span.kind} {g.span.size}" for g in groups.windowed}))
        for flag, value, active in (("--disaggregation-mode", config.disaggregation_mode,
                                     config.disaggregation_mode != "none"), ("--cp", config.cp, config.cp > 1)):
            if active:
                raise EngineConfigError(f"{flag} {value}: this model keeps windowed KV cache groups ({kinds}) beside "
                                        "its full layers, which a KV transfer and context parallelism do not move yet")
        pools = tuple(window_pool_blocks(g.span, config.block_size, config.max_num_seqs,
                                         config.max_num_batched_tokens) for g in groups.windowed)
        return cls(groups, pools, drafter_layers=drafter_layers)

    @property
    def windows(self) -> tuple[tuple[AttentionSpan, int], ...]:
        """(span, pool blocks) of each windowed group, in group order (what the block manager keeps)."""
        return tuple((g.span, blocks) for g, blocks in zip(self.groups.windowed, self.window_blocks))


def _state_slots(config: EngineConfig, state_layers: tuple[int, ...]) -> int:
    """One slot per sequence that may run (`max_num_seqs`); refuses, naming the flag, what does not move states
    (a P/D transfer moves them beside the KV blocks: moe_runtime/disaggregation/kv_transfer/state_plan.py)."""
    if config.cp > 1:
        raise EngineConfigError(f"--cp {config.cp}: this model's linear-attention layers ({len(state_layers)}) keep "
                                "recurrent states, which context parallelism does not split yet")
    return config.max_num_seqs
