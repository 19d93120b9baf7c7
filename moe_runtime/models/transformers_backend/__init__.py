"""The transformers backend: any transformers `*ForCausalLM` served through transformers' own modeling code,
with our attention and our MoE seam plugged in (`--model-impl transformers`, or `auto` for an architecture
with no native builder).

The pieces, one concept each:
- build.py: the model built on the meta device from its transformers class, with
  attn_implementation / experts_implementation "moe_runtime", the executor's MoE layers registered.
- step_context.py: the per-forward `StepContext` (the step's AttentionBatch and paged caches) hung on every
  module with a `layer_idx`: how transformers' attention calls find the engine's state (no module globals).
- attention.py (+ softcap_attention.py): the attention function: new K/V into the paged cache, causal
  attention over the ragged batch with our kernels; scaling, sliding windows, soft-capping, sinks, GQA.
- kv_specs.py: each layer's KV cache spec from the config, checked against the first call.
- experts.py: the experts function and `ExpertsSeam`: transformers' fused expert stacks become this rank's
  `ExpertWeights`, and each call goes through `MoEExecutor.run` (EP dispatch/combine, DP attention, EPLB).
- loading.py: the checkpoint loaded by transformers' conversion rules through our reader; unmatched tensor
  names refused before anything is read.
- model.py: `TransformersCausalLM`, the surface the engine uses (forward, logits, kv_cache_specs, ...).
- support.py: what the backend refuses, by flag or layer type.
- tensor_parallel.py, pipeline_stages.py, parallel_model.py: the model split over ranks by its own tp_plan
  (attention TP: head-split projections, row-parallel all-reduce) and pp_plan (this stage's layers), read
  from the checkpoint as this rank's share.

Seam for layers with recurrent state (Mamba, linear attention, short convolutions): such layers are refused by
layer type today (support.check_config). To serve them, (1) add a per-layer-type state entry beside
`StepContext.layers` (e.g. `states: dict[int, LayerState]` by layer index, with the state cache the engine
allocates for state layers, `AttentionBatch.state_slots` giving each sequence's slot), (2) have the module's
forward read it: either a hook registered for that module class that swaps transformers' `cache_params` /
`past_key_values` argument for a view of the engine's state slots, or a forward pre-hook placed by
`hang_step_context` on modules whose `layer_idx` names a state layer, and (3) return the state layers' specs
from `TransformersCausalLM.kv_cache_specs` the way `engine.state_slots.state_layers` expects. The wrapper's
forward stays one call into transformers' base model; all per-layer state flows through the StepContext.
"""
from moe_runtime.models.transformers_backend.build import build_transformers_model
from moe_runtime.models.transformers_backend.model import TransformersCausalLM

__all__ = ["TransformersCausalLM", "build_transformers_model"]
