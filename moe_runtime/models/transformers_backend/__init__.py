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
- kv_specs.py: each layer's KV cache spec, read from the config; probe.py replaces the shapes by what each
  layer's attention module computes (one stand-in token after loading) and refuses at start-up what a layer
  hands its attention that we cannot run; each layer's first real call is checked against the result.
- experts.py: the experts function and `ExpertsSeam`: transformers' fused expert stacks become this rank's
  `ExpertWeights`, and each call goes through `MoEExecutor.run` (EP dispatch/combine, DP attention, EPLB).
- loading.py: the checkpoint loaded by transformers' conversion rules through our reader; unmatched tensor
  names refused before anything is read.
- model.py: `TransformersCausalLM`, the surface the engine uses (forward, logits, kv_cache_specs, ...). An
  idle rank (no tokens: a DP attention worker with nothing scheduled) runs one stand-in token
  (`StepContext.stand_in`) so its MoE layers still meet the EP group's collectives; anything that keeps
  per-layer state must skip its work when that flag is set.
- support.py: what the backend refuses, by flag, layer type, or module that counts positions along its row.
- tensor_parallel.py, pipeline_stages.py, parallel_model.py: the model split over ranks by its own tp_plan
  (attention TP: head-split projections, row-parallel all-reduce) and pp_plan (this stage's layers), read
  from the checkpoint as this rank's share.

Layers with recurrent state (Mamba, Mamba2, linear attention, short convolutions; attention layers with a state
beside): recurrent_state.py reads each one's state shapes from the config (per model type; unknown ones refused by
name in support.check_config) and packs them into one state-slot spec, which `kv_cache_specs` returns for those
layers (an attention layer keeping a state too has both: its KV spec in place, its state spec after the
decoder's); recurrent_mixers.py gives each module that keeps such a state a forward of its own that runs
transformers' code sequence by sequence (decode rows together) inside the one batched forward, its state moved
between our slots (`StepContext.caches`, `AttentionBatch.state_slots`) and transformers' cache object by
recurrent_bridge.py; prefix-cache snapshots are written at the block boundaries the runner asks for.

Attention layers that build more than query/key/value from transformers' cache and mask (sparse-attention indexers,
Inkling's relative position bias): own_cache_attention.py runs each one's module per sequence with eager attention,
a real causal mask and a transformers cache backed by the layer's paged KV cache (paged_hf_cache.py).
"""
from moe_runtime.models.transformers_backend.build import build_transformers_model
from moe_runtime.models.transformers_backend.model import TransformersCausalLM

__all__ = ["TransformersCausalLM", "build_transformers_model"]
