"""Qwen3-Next's (and Qwen3.5-MoE's) multi-token-prediction module, as their checkpoints store it under `mtp.`.

`mtp.pre_fc_norm_embedding` and `mtp.pre_fc_norm_hidden` ((1 + w) RMSNorms), `mtp.fc` (2H -> H), one decoder
block `mtp.layers.0` built like the family's full-attention layers (gated attention, the MoE block with its gated
shared expert; `HybridLayerFactory`) and `mtp.norm`; the embedding and LM head are the main model's. At position
p, with h_p the main model's final hidden state and t[p + 1] the token after it (vLLM's reading of the module):

    x = fc(cat(pre_fc_norm_embedding(embed(t[p + 1])), pre_fc_norm_hidden(h_p)))
    y = norm(block(x))                                       (attention over its own KV cache of such rows)
    logits = lm_head(y)

Chained as a drafter, y (already normed) stands in for h at the next position. Unlike DeepSeek-V3's module
(moe_runtime/models/deepseek_mtp.py) nothing is zeroed at position 0.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.hybrid_norms import OffsetRMSNorm
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Linear
from moe_runtime.models.decoder import BuildContext, CausalLM
from moe_runtime.models.qwen3_next import HybridLayerFactory

FULL_ATTENTION = "full_attention"
MTP_PREFIX = "mtp."                  # every tensor of the module in the checkpoint
MTP_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")


class Qwen3NextMtp(nn.Module):
    def __init__(self, architecture: str, cfg, ctx: BuildContext, target: CausalLM):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, eps, ctx.dtype, ctx.device)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, eps, ctx.dtype, ctx.device)
        self.fc = Linear(2 * hidden, hidden, False, ctx.dtype, ctx.device)
        # the block is layer 0 of the module (vLLM builds it so: its dense/sparse choice is layer 0's)
        self.layers = nn.ModuleList([HybridLayerFactory.of(architecture, cfg, ctx).layer(0, FULL_ATTENTION)])
        self.norm = OffsetRMSNorm(hidden, eps, ctx.dtype, ctx.device)
        self._target = [target]        # the main model's embedding and LM head (unregistered)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.layers[0].self_attn.kv_cache_spec()

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H]: the target's final hidden states as they are
        return hidden

    def predict(self, positions: torch.Tensor, token_ids: torch.Tensor, previous: torch.Tensor,
                batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor:  # [T], [T], [T, H] -> [T, H]
        """The module's normed output y at each row (module doc)."""
        embeds = self._target[0].model.embed_tokens(token_ids)                                 # [T, H]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(previous)], dim=-1))
        return self.norm(self.layers[0](positions, x, batch, cache))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] fp32
        return self._target[0].logits(hidden)


class Qwen3NextMtpCheckpointView(nn.Module):
    """Holds a `Qwen3NextMtp` under the checkpoint's names (mtp.*) for the weight loader."""

    def __init__(self, module: Qwen3NextMtp):
        super().__init__()
        self.mtp = module


def qwen3_next_mtp_layers(cfg, names: set[str]) -> int:
    """The checkpoint's MTP layers: `num_nextn_predict_layers` where its config names it, else the blocks stored."""
    stated = getattr(cfg, "num_nextn_predict_layers", None)
    if stated is not None:
        return int(stated)
    if f"{MTP_PREFIX}fc.weight" not in names:
        return 0
    return len({name.split(".")[2] for name in names if name.startswith(f"{MTP_PREFIX}layers.")})
