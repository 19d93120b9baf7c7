"""A step of a model with recurrent layers (Mamba, Mamba2, short convolutions, linear attention), run through
transformers one sequence at a time, its states kept in our state cache.

transformers' mixers take a [B, T] batch with one sequence per row and read their state from transformers' cache
object; they know no packed ragged batch. So each sequence of the step runs its own forward of its scheduled
tokens ([1, T_b], its positions), with a fresh transformers cache into which `RecurrentStateBridge` loads the
sequence's states from its slot (or leaves them empty when its first token is in the step: transformers' prefill
path, as `generate` runs it), and from which it stores them back afterwards. Attention still goes to the paged
KV cache (attention.py) through a one-sequence view of the step's batch; the cache's attention layers only see
this forward's K/V and are dropped with it.

Prefix caching: where the step crosses a block boundary whose state the block manager snapshots (the runner's
`LayerStateCache.captures`, offsets into the sequence's scheduled tokens; speculation's draft checkpoints arrive
the same way), the sequence's tokens are run in pieces cut there, and the slot's state after each piece is
copied into the snapshot row, so a later request resumes from it as from a Qwen3-Next snapshot.

Cost: one transformers forward per sequence per step (plus one per snapshot cut) instead of one per step; decode
steps of many sequences pay it most (every MoE layer runs once per sequence).
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.execution.attention_batch import AttentionBatch
from moe_runtime.layers.state_cache import LayerStateCache, StateSpec
from moe_runtime.models.transformers_backend.recurrent_bridge import RecurrentStateBridge
from moe_runtime.models.transformers_backend.recurrent_state import RecurrentLayout


class RecurrentSteps:
    def __init__(self, layout: RecurrentLayout, hf_config, dtype: torch.dtype):
        self.layout = layout
        self.hf_config = hf_config
        self.bridge = RecurrentStateBridge(layout, dtype)

    def state_spec(self) -> StateSpec:
        return self.layout.state_spec()

    def forward(self, base_model: nn.Module, step, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch, caches: list) -> torch.Tensor:  # [T] -> [T, H]
        """The step's final hidden states, sequence by sequence (`step`: the attention's StepContext, whose batch
        is set to each piece's one-sequence view while it runs)."""
        if batch.state_slots is None:
            raise RuntimeError("a step of a model with recurrent layers came without state slots "
                               "(moe_runtime/engine/state_slots.py did not see its layers)")
        states = {layer: caches[layer] for layer in self.layout.layer_indices}
        captures = next(iter(states.values())).captures
        pieces = []
        for b, slot in enumerate(batch.state_slots):
            start, stop = batch.query_start[b], batch.query_start[b + 1]
            past = batch.context_lens[b] - batch.query_lens[b]
            rows = {}
            for offset, row in captures.get(slot, ()):
                rows.setdefault(offset, []).append(row)
            cuts = sorted({offset for offset in rows if 0 < offset < stop - start} | {stop - start})
            first = 0
            for cut in cuts:
                step.batch = _one_sequence(batch, b, first, cut)
                try:
                    pieces.append(self._run(base_model, input_ids[start + first:start + cut],
                                            positions[start + first:start + cut], states, slot, past + first))
                finally:
                    step.batch = None
                for row in rows.get(cut, ()):
                    for cache in states.values():
                        cache.ssm[row] = cache.ssm[slot]
                first = cut
        if not pieces:
            return torch.empty(0, self.hf_config.hidden_size, device=input_ids.device)
        return torch.cat(pieces)

    def _run(self, base_model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
             states: dict[int, LayerStateCache], slot: int, past: int) -> torch.Tensor:  # [t] -> [t, H]
        hf_cache = self._new_cache()
        self.bridge.load(hf_cache, states, [slot], fresh=past == 0, num_tokens=input_ids.shape[0], past_tokens=past)
        out = base_model(input_ids=input_ids[None], position_ids=positions[None], cache=hf_cache, use_cache=True)
        self.bridge.store(hf_cache, states, [slot])
        return out.last_hidden_state[0]

    def _new_cache(self):
        """transformers' cache for one forward: its own class where the model insists (MiniMax)."""
        if self.layout.linear_cache:
            from transformers.models.minimax.modeling_minimax import MiniMaxCache

            return MiniMaxCache()
        from transformers import DynamicCache

        return DynamicCache(config=self.hf_config)


def _one_sequence(batch: AttentionBatch, b: int, first: int, cut: int) -> AttentionBatch:
    """Sequence b's view of the step for its scheduled tokens [first, cut): what its attention reads and writes."""
    start = batch.query_start[b]
    context = batch.context_lens[b] - batch.query_lens[b] + cut
    view = AttentionBatch([cut - first], [context], [0, cut - first],
                          batch.slot_mapping[start + first:start + cut], batch.block_tables[b:b + 1],
                          torch.tensor([context], dtype=torch.int32, device=batch.context_lens_tensor.device),
                          batch.block_size)
    view.state_slots = [batch.state_slots[b]]
    if batch.prompt_lens is not None:
        view.prompt_lens = [batch.prompt_lens[b]]
    return view
