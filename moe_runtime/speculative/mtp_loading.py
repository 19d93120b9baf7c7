"""Building the MTP drafter: which checkpoints can (DeepSeek-V3's, GLM-4.5's, DeepSeek-V3.2's and GLM-5's module
after the last layer, Qwen3-Next's and Qwen3.5-MoE's under `mtp.`, DeepSeek-V4's under `mtp.0.`), the module built
like the target's layers and loaded from the same checkpoint, its MoE block on an executor of its own. Refusals name
what is missing.

DeepSeek-V4's layer keeps per-sequence state like the target's layers: its `LayerCompressedCache` has as many
state rows as theirs (the slots, a scratch row, the prefix cache's snapshot rows), and the runner restores and
snapshots it with theirs (`ModelRunner.drafter_state_caches`)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from moe_runtime.config.model_config import architecture_of
from moe_runtime.errors import InvalidRequestError
from moe_runtime.execution.model_runner import state_rows
from moe_runtime.layers.compressed_cache import LayerCompressedCache
from moe_runtime.models.deepseek_mtp import MTP_BLOCKS, MtpCheckpointView, MtpLayer, MtpTensors
from moe_runtime.models.deepseek_v4_mtp import (MTP_PREFIX as V4_MTP_PREFIX, V4MtpCheckpointView, V4MtpLayer,
                                                 V4MtpTensors)
from moe_runtime.models.qwen3_next_mtp import (MTP_ARCHITECTURES as QWEN3_NEXT_MTP, MTP_PREFIX, Qwen3NextMtp,
                                               Qwen3NextMtpCheckpointView, qwen3_next_mtp_layers)
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.speculative.draft_source import DraftSource
from moe_runtime.speculative.mtp import MtpDrafter
from moe_runtime.weights.loading import SkippedTensor, SkippedTensors, load_model_weights


DEEPSEEK_V4 = "DeepseekV4ForCausalLM"


@dataclass(frozen=True)
class MtpLocation:
    """Where a checkpoint keeps its MTP module: how many layers, and the prefix of its tensors."""

    layers: int
    prefix: str                  # model.layers.N. (DeepSeek-V3, GLM-4.5, V3.2, GLM-5), mtp. (Qwen3-Next)
    present: bool                # its tensors are in the files

    @classmethod
    def of(cls, architecture: str, cfg, names: set[str]) -> "MtpLocation":
        if architecture in QWEN3_NEXT_MTP:
            return cls(qwen3_next_mtp_layers(cfg, names), MTP_PREFIX, f"{MTP_PREFIX}fc.weight" in names)
        if architecture == DEEPSEEK_V4:
            return cls(getattr(cfg, "num_nextn_predict_layers", 0) or 0, V4_MTP_PREFIX, V4MtpTensors.present(names))
        index = cfg.num_hidden_layers
        return cls(getattr(cfg, "num_nextn_predict_layers", 0) or 0, f"model.layers.{index}.",
                   MtpTensors.present(names, index))


def build_mtp_drafter(source: DraftSource, k: int) -> MtpDrafter:
    cfg = source.target.hf_config
    architecture = architecture_of(cfg)
    names = set(source.reader.names())
    where = MtpLocation.of(architecture, cfg, names)
    built = (*MTP_BLOCKS, *QWEN3_NEXT_MTP, DEEPSEEK_V4)
    if architecture not in built or where.layers < 1 or not where.present:
        raise InvalidRequestError(
            f"speculative_config method 'mtp': {architecture} at {source.reader.directory} has no "
            f"multi-token-prediction layer to draft with (num_nextn_predict_layers={where.layers}, tensors "
            f"{where.prefix}*; built for {', '.join(built)}); use method 'ngram'")
    if where.layers > 1:
        raise InvalidRequestError(f"speculative_config method 'mtp' with num_nextn_predict_layers={where.layers} is "
                                  "not built: each further layer would need the previous one's outputs at every "
                                  "position")
    parallel = source.ctx.parallel
    if parallel.cp_size > 1:
        raise InvalidRequestError("speculative_config method 'mtp' with --cp is not built yet: the MTP pass would "
                                  "have to split its rows over the context-parallel ranks; use method 'ngram' there")
    executor = MoEExecutor.for_engine(source.config, source.ctx.parallel, source.ctx.kernels, cfg.hidden_size,
                                      source.ctx.dtype)
    ctx = dataclasses.replace(source.ctx, executor=executor)
    cache = None
    if architecture in QWEN3_NEXT_MTP:
        layer = Qwen3NextMtp(architecture, cfg, ctx, source.target)
        view = Qwen3NextMtpCheckpointView(layer)
    elif architecture == DEEPSEEK_V4:
        layer = V4MtpLayer(cfg, ctx, V4MtpTensors.find(names), source.target)
        view = V4MtpCheckpointView(layer)
        runner = source.runner
        cache = LayerCompressedCache.allocate(layer.kv_cache_spec(), source.num_blocks, runner.block_size,
                                              state_rows(runner.state_slots), source.ctx.dtype, source.ctx.device)
        runner.drafter_state_caches.append(cache)
        source.target.keep_streams()
    else:
        index = cfg.num_hidden_layers
        layer = MtpLayer(cfg, ctx, MtpTensors.find(names, index), source.target,
                         MTP_BLOCKS[architecture](cfg, ctx, index))
        view = MtpCheckpointView(layer, index)
    executor.finish_registration()
    others = SkippedTensor(rf"^(?!{re.escape(where.prefix)})", "the target model's, not the MTP layer's")
    several = parallel.world_size > parallel.pp_size   # ranks per stage: the MTP layer's experts spread over them
    load_model_weights(view, source.reader, SkippedTensors((others,)),
                       parallel.ep_control_group if several else None)   # the (last) stage's ranks: the world at --pp 1
    layer.eval()
    source.runner.keep_hidden = True
    return MtpDrafter(layer, executor, source.num_blocks, source.runner.block_size, source.ctx.dtype,
                      source.ctx.device, k, lock_step=several, cache=cache, checkpoint_view=view)
