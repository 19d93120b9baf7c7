"""DeepSeek-V3's multi-token-prediction (MTP) module, as its checkpoints store it after the last decoder layer
(GLM-4.5's is the same module around a GLM-4.5 decoder block; DeepSeek-V3.2's and GLM-5's around a sparse-attention
block whose lightning indexer is its own, even where GLM-5's last layers share one, as vLLM and SGLang run it:
`MTP_BLOCKS`).

Layer N = num_hidden_layers (+ i for the i-th of `num_nextn_predict_layers`) holds, under `model.layers.N.`:
`enorm` and `hnorm` (RMSNorms), `eh_proj` (2H -> H), a whole decoder block (`self_attn`, `mlp`, its two norms)
and `shared_head` (`norm`, and `head`, a copy of the LM head); DeepSeek-V3's files also carry `embed_tokens`, a
copy of the embedding. At position p it reads the main model's final hidden state h_p (after the final norm)
and the embedding of the token at p + 1, and predicts the token at p + 2:

    x = eh_proj(cat(enorm(embed(t[p + 1])), hnorm(h_p)))     (the embedding zeroed at position 0, as vLLM does)
    y = block(x)                                             (attention over its own KV cache of such rows)
    logits = head(shared_head.norm(y))

Chained as a drafter, y stands in for h at the next position (vLLM's and SGLang's rule). The block is built
like the main model's layers (`MTP_BLOCKS`), so FP8 checkpoints load the same way; `eh_proj` and
`shared_head.head` are read quantized when the checkpoint stores their scales. `MtpCheckpointView` gives the
layer the checkpoint's parameter names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Embedding, Linear
from moe_runtime.layers.norm import RMSNorm
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer
from moe_runtime.models.deepseek import (DeepseekLayout, LayerParts, deepseek_layer_parts, deepseek_mlp,
                                         deepseek_v3_routing)
from moe_runtime.models.deepseek_v32 import sparse_attention
from moe_runtime.models.glm4_moe import glm4_moe_layer_parts


@dataclass(frozen=True)
class MtpTensors:
    """Which optional tensors the checkpoint has for MTP layer `index`."""

    index: int
    own_embedding: bool            # model.layers.N.embed_tokens.weight (else the main model's embedding)
    own_head: bool                 # model.layers.N.shared_head.head.weight (else the main model's LM head)
    quantized_eh_proj: bool        # eh_proj.weight_scale_inv: stored FP8
    quantized_head: bool

    @classmethod
    def find(cls, names: set[str], index: int) -> "MtpTensors":
        prefix = f"model.layers.{index}."
        return cls(index, f"{prefix}embed_tokens.weight" in names, f"{prefix}shared_head.head.weight" in names,
                   f"{prefix}eh_proj.weight_scale_inv" in names, f"{prefix}shared_head.head.weight_scale_inv" in names)

    @staticmethod
    def present(names: set[str], index: int) -> bool:
        return f"model.layers.{index}.eh_proj.weight" in names


class SharedHead(nn.Module):
    def __init__(self, cfg, ctx: BuildContext, tensors: MtpTensors):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.kernels, ctx.dtype, ctx.device)
        self.head = (Linear(cfg.hidden_size, cfg.vocab_size, False, ctx.dtype, ctx.device,
                            quant=ctx.linear_quant if tensors.quantized_head else None)
                     if tensors.own_head else None)


class MtpLayer(DecoderLayer):
    """One MTP module: a DeepSeek decoder block with its input projection and output head (module doc)."""

    def __init__(self, cfg, ctx: BuildContext, tensors: MtpTensors, target: CausalLM, parts: LayerParts):
        """`parts`: the block's attention and MLP, built like the target's layers (`MTP_BLOCKS`)."""
        super().__init__(parts.attention, parts.mlp, cfg.hidden_size, cfg.rms_norm_eps, ctx)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps, ctx.kernels, ctx.dtype, ctx.device)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps, ctx.kernels, ctx.dtype, ctx.device)
        self.eh_proj = Linear(2 * hidden, hidden, False, ctx.dtype, ctx.device,
                              quant=ctx.linear_quant if tensors.quantized_eh_proj else None)
        self.shared_head = SharedHead(cfg, ctx, tensors)
        self.embed_tokens = Embedding(cfg.vocab_size, hidden, ctx.dtype, ctx.device) if tensors.own_embedding else None
        self._target = [target]        # the main model's embedding and LM head where no copy is stored (unregistered)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.self_attn.kv_cache_spec()

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H]: the target's final hidden states as they are
        return hidden

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        embedding = self.embed_tokens if self.embed_tokens is not None else self._target[0].model.embed_tokens
        return embedding(token_ids)

    def predict(self, positions: torch.Tensor, token_ids: torch.Tensor, previous: torch.Tensor,
                batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor:  # [T], [T], [T, H] -> [T, H]
        """The module's output y at each row: `token_ids` are the tokens after each position, `previous` the
        hidden states there (the main model's, or the previous MTP output when chained)."""
        embeds = self.embed(token_ids).masked_fill((positions == 0)[:, None], 0.0)            # [T, H]
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))       # [T, H]
        return self(positions, x, batch, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] fp32
        normed = self.shared_head.norm(hidden)
        if self.shared_head.head is not None:
            return self.shared_head.head(normed).float()
        return self._target[0].logits(normed)


def deepseek_v3_mtp_block(cfg, ctx: BuildContext, index: int) -> LayerParts:
    return deepseek_layer_parts(cfg, ctx, DeepseekLayout.v3(cfg), index)


def sparse_mtp_block(*, interleaved_indexer_rope: bool):
    """DeepSeek-V3.2's (indexer rotated in halves) or GLM-5's (in interleaved pairs) block, as
    models/deepseek_v32.py builds a layer with an indexer: MLA over the tokens the block's own lightning indexer
    chooses (its index keys beside its latents in the layer's cache), routed and shared experts."""
    def build(cfg, ctx: BuildContext, index: int) -> LayerParts:
        attention = sparse_attention(cfg, ctx, index, interleaved_indexer_rope, own=True)
        return LayerParts(attention, deepseek_mlp(cfg, ctx, deepseek_v3_routing(cfg), True, index))

    return build


# the architectures whose checkpoints carry this module, and how each builds its block (layer `index`)
MTP_BLOCKS = {"DeepseekV3ForCausalLM": deepseek_v3_mtp_block, "Glm4MoeForCausalLM": glm4_moe_layer_parts,
              "DeepseekV32ForCausalLM": sparse_mtp_block(interleaved_indexer_rope=False),
              "GlmMoeDsaForCausalLM": sparse_mtp_block(interleaved_indexer_rope=True)}


class MtpCheckpointView(nn.Module):
    """Holds an `MtpLayer` under the checkpoint's names (model.layers.N.*) for the weight loader."""

    def __init__(self, layer: MtpLayer, index: int):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(index): layer})

