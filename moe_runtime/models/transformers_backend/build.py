"""Build the engine's model from a transformers causal-LM class: meta construction, our attention and experts
implementations, the executor's MoE layers registered in model order."""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_backend import attention_kernels_for
from moe_runtime.models.decoder import BuildContext
from moe_runtime.models.transformers_backend.attention import ATTENTION_IMPLEMENTATION, register_attention
from moe_runtime.models.transformers_backend.experts import (EXPERTS_IMPLEMENTATION, SEAM_ATTRIBUTE, ExpertsSeam,
                                                             experts_shape, is_interface_experts, register_experts,
                                                             seam_activation)
from moe_runtime.models.transformers_backend.kv_specs import layer_attention
from moe_runtime.models.transformers_backend.own_cache_attention import install_own_cache_attention, own_cache_layers
from moe_runtime.models.transformers_backend.recurrent_mixers import install_recurrent_mixers
from moe_runtime.models.transformers_backend.recurrent_state import served_layout
from moe_runtime.models.transformers_backend.model import (TransformersCausalLM, TransformersExpertWeights,
                                                           TransformersModel)
from moe_runtime.models.transformers_backend.parallel_model import (SplitTransformersCausalLM, SplitTransformersModel,
                                                                    split_model)
from moe_runtime.models.transformers_backend.step_context import StepContext, hang_step_context
from moe_runtime.models.transformers_backend.support import check_config, check_engine, transformers_class
from moe_runtime.weights.loading import SkippedTensors

logger = logging.getLogger(__name__)


def build_transformers_model(architecture: str, hf_config, ctx: BuildContext) -> TransformersCausalLM:
    cls = transformers_class(architecture)
    check_config(architecture, hf_config)
    p = ctx.parallel
    check_engine(architecture, p.pp_size, p.attn_tp_size, p.cp_size, None if ctx.quant is None else ctx.quant.name,
                 ctx.engine)
    register_attention()
    register_experts()
    config = copy.deepcopy(hf_config)
    with torch.device("meta"):
        hf = cls._from_config(config, dtype=ctx.dtype, attn_implementation=ATTENTION_IMPLEMENTATION,
                              experts_implementation=EXPERTS_IMPLEMENTATION)
    hf.eval()
    split = split_model(architecture, hf, ctx.parallel, ctx.dtype)   # tp / pp plans: parallel_model.py (None: one rank)
    layers = [layer_attention(hf_config, i) for i in range(hf_config.num_hidden_layers)]
    if split is not None:
        layers = split.local_layers(layers)
    step = StepContext(attention_kernels_for(ctx.kernels, torch.device(ctx.device)), layers)
    if hang_step_context(hf, step) == 0:
        raise UnsupportedArchitectureError(f"transformers backend: {architecture} has no module with a layer_idx "
                                           "(its attention cannot find its layer's KV cache)")
    layout = served_layout(hf_config)
    if layout is not None:   # recurrent mixers run sequence by sequence on our state slots
        install_recurrent_mixers(hf, layout, step, ctx.dtype)
    own_cache = own_cache_layers(hf_config)
    if own_cache:   # attention with transformers' own cache and mask, sequence by sequence (own_cache_attention.py)
        if split is not None:
            raise UnsupportedArchitectureError(
                f"transformers backend: {architecture}'s layers {own_cache} run their attention with transformers' "
                "cache and mask, which is not split over ranks (--pp / attention TP)")
        install_own_cache_attention(hf, own_cache, step)
    seams, routed = _bind_experts(architecture, hf, ctx, step)
    if ctx.engine is not None and ctx.engine.enable_two_batch_overlap and seams:
        logger.info("transformers backend (%s): --enable-two-batch-overlap: each step runs as one batch (transformers' "
                    "modules cannot yield mid-layer), every rank alike, so the MoE collectives still pair up",
                    architecture)
    if split is None:
        backbone = TransformersModel(hf, seams, torch.device(ctx.device), ctx.dtype)
    else:   # this rank's share: parallel_model.py
        backbone = SplitTransformersModel(hf, seams, torch.device(ctx.device), ctx.dtype, split)
    backbone.skipped = SkippedTensors.for_config(hf_config)
    lm = TransformersCausalLM if split is None else SplitTransformersCausalLM
    return lm(hf_config, backbone, routed, step, ctx.executor)


def _bind_experts(architecture: str, hf: nn.Module, ctx: BuildContext, step: StepContext
                  ) -> tuple[list[tuple[str, ExpertsSeam]], list[TransformersExpertWeights]]:
    """Register every experts module the seam can serve with the executor, in model order; log the others."""
    seams, routed, own_code, num_experts = [], [], {}, 0
    executor = ctx.executor
    for name, module in hf.named_modules():
        if not is_interface_experts(module):
            if name.endswith("experts") and any(True for _ in module.parameters()):
                own_code.setdefault(type(module).__name__, []).append(name)
            continue
        activation = seam_activation(module)
        if isinstance(activation, str):
            own_code.setdefault(f"{type(module).__name__} ({activation})", []).append(name)
            continue
        shape = experts_shape(module)
        num_experts = shape.num_experts
        weights = TransformersExpertWeights(
            executor.local_expert_ids(shape.num_experts), shape.hidden_size, shape.intermediate_size,
            dtype=ctx.dtype, device=executor.routed_expert_device(ctx.device), quant=ctx.quant,
            bias=bool(module.has_bias), activation=activation)
        seam = ExpertsSeam(executor, executor.register_layer(weights, shape.num_experts), weights, step,
                           shape.num_experts)
        object.__setattr__(module, SEAM_ATTRIBUTE, seam)
        seams.append((name, seam))
        routed.append(weights)
    for what, names in own_code.items():
        logger.info("transformers backend (%s): %d experts module(s) %s run transformers' own code, every rank "
                    "holding all their experts (%s, ...)", architecture, len(names), what, names[0])
    if seams:
        logger.info("transformers backend (%s): %d MoE layer(s) of %d experts through the executor", architecture,
                    len(seams), num_experts)
    return seams, routed
