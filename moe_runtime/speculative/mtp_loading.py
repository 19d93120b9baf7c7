"""Building the MTP drafter: which checkpoints can, the layer built like the target's and loaded from the same
checkpoint, its MoE block on an executor of its own. Refusals name what is missing."""
from __future__ import annotations

import dataclasses

from moe_runtime.config.model_config import architecture_of
from moe_runtime.errors import InvalidRequestError
from moe_runtime.models.deepseek_mtp import MtpCheckpointView, MtpLayer, MtpTensors
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.speculative.draft_source import DraftSource
from moe_runtime.speculative.mtp import MtpDrafter
from moe_runtime.weights.loading import SkippedTensor, SkippedTensors, load_model_weights

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def build_mtp_drafter(source: DraftSource, k: int) -> MtpDrafter:
    cfg = source.target.hf_config
    architecture = architecture_of(cfg)
    layers = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    index = cfg.num_hidden_layers
    names = set(source.reader.names())
    if architecture not in MTP_ARCHITECTURES or layers < 1 or not MtpTensors.present(names, index):
        raise InvalidRequestError(
            f"speculative_config method 'mtp': {architecture} at {source.reader.directory} has no "
            f"multi-token-prediction layer to draft with (num_nextn_predict_layers={layers}, tensors "
            f"model.layers.{index}.*; built for {', '.join(MTP_ARCHITECTURES)}); use method 'ngram'")
    if layers > 1:
        raise InvalidRequestError(f"speculative_config method 'mtp' with num_nextn_predict_layers={layers} is not "
                                  "built: each further layer would need the previous one's outputs at every position")
    parallel = source.ctx.parallel
    if parallel.cp_size > 1:
        raise InvalidRequestError("speculative_config method 'mtp' with --cp is not built yet: the MTP pass would "
                                  "have to split its rows over the context-parallel ranks; use method 'ngram' there")
    if source.runner.capture is not None:
        raise InvalidRequestError("speculative_config method 'mtp' with enable_torch_compile is not built: a captured "
                                  "decode step does not keep the hidden states the MTP layer reads")
    executor = MoEExecutor.for_engine(source.config, source.ctx.parallel, source.ctx.kernels, cfg.hidden_size,
                                      source.ctx.dtype)
    layer = MtpLayer(cfg, dataclasses.replace(source.ctx, executor=executor), MtpTensors.find(names, index),
                     source.target)
    executor.finish_registration()
    others = SkippedTensor(rf"^(?!model\.layers\.{index}\.)", "the target model's, not the MTP layer's")
    load_model_weights(MtpCheckpointView(layer, index), source.reader, SkippedTensors((others,)),
                       parallel.world_control_group if parallel.world_size > 1 else None)   # experts spread over EP
    layer.eval()
    source.runner.keep_hidden = True
    return MtpDrafter(layer, executor, source.num_blocks, source.runner.block_size, source.ctx.dtype,
                      source.ctx.device, k, lock_step=parallel.world_size > 1)
