"""An EAGLE-3 draft head (`LlamaForCausalLMEagle3`), as the published heads store it in a directory of their own.

config.json is a Llama config (hidden_size, heads, intermediate_size, rms_norm_eps, rotary) with `draft_vocab_size`
and optionally `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`. Tensors:

    fc.weight                       [H, 3 Ht]  over the concatenation of three target hidden states
    midlayer.input_layernorm        RMSNorm of the token embedding
    midlayer.hidden_norm            RMSNorm of the hidden input
    midlayer.self_attn.{q,k,v,o}_proj   q/k/v read cat(embeds, hidden): 2H wide
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight     [draft_vocab, H]
    d2t                             [draft_vocab] int64: target id = draft id + d2t[draft id]
    t2d                             [vocab] bool (not needed to draft)
    embed_tokens.weight             optional; else the target's embedding

At position p, with a_p the target's residual stream entering each of the three aux layers (`aux_layers`,
default (2, L // 2, L - 3) of L layers: vLLM's) concatenated, and t[p + 1] the token after p:

    h = fc(a_p)                                   (the first pass; chained passes take the head's own output)
    r = h + attn(cat(input_layernorm(embed(t[p + 1])), hidden_norm(h)))     (its own KV cache)
    y = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(y)), scattered into the target's vocabulary through d2t (-inf elsewhere)

y (before `norm`) stands in for h at the next position when chained (vLLM's rule for EAGLE-3). The head has no
MoE block and no cross-rank exchange: every rank holds it whole.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention import Attention, AttentionShape
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Linear
from moe_runtime.layers.norm import RMSNorm
from moe_runtime.models.common import head_dim_of, rotary_for
from moe_runtime.models.decoder import BuildContext, CausalLM
from moe_runtime.moe.dense_mlp import DenseMLP


def eagle3_aux_layers(head_cfg, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual streams the head reads, in layer order."""
    eagle = getattr(head_cfg, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_layers // 2, target_layers - 3)
    return tuple(sorted(ids))


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg, ctx: BuildContext):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        head_dim = head_dim_of(cfg)
        shape = AttentionShape(hidden_size=hidden, num_heads=cfg.num_attention_heads,
                               num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                               head_dim=head_dim, qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                               norm_eps=eps, input_size=2 * hidden)
        self.self_attn = Attention(shape, rotary_for(cfg, head_dim, ctx.device), ctx.kernels, ctx.dtype, ctx.device)
        self.input_layernorm = RMSNorm(hidden, eps, ctx.kernels, ctx.dtype, ctx.device)
        self.hidden_norm = RMSNorm(hidden, eps, ctx.kernels, ctx.dtype, ctx.device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ctx.kernels, ctx.dtype, ctx.device)
        self.mlp = DenseMLP(hidden, cfg.intermediate_size, ctx.kernels, ctx.dtype, ctx.device)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch,
                cache: LayerKVCache) -> torch.Tensor:  # [T, H] x 2 -> [T, H]
        mixed = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)     # [T, 2H]
        residual = hidden + self.self_attn(positions, mixed, batch, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Head(nn.Module):
    """The head under its checkpoint's names (module doc); `predict` / `logits` as the MTP drafter calls them."""

    def __init__(self, cfg, ctx: BuildContext, target: CausalLM, own_embedding: bool):
        super().__init__()
        hidden = cfg.hidden_size
        target_hidden = getattr(cfg, "target_hidden_size", None) or hidden
        draft_vocab = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.fc = Linear(3 * target_hidden, hidden, False, ctx.dtype, ctx.device)
        self.midlayer = Eagle3MidLayer(cfg, ctx)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, ctx.kernels, ctx.dtype, ctx.device)
        self.lm_head = Linear(hidden, draft_vocab, False, ctx.dtype, ctx.device)
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long, device=ctx.device), requires_grad=False)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, hidden, dtype=ctx.dtype, device=ctx.device)
                             if own_embedding else None)
        self.vocab_size = target.hf_config.vocab_size
        self._target = [target]        # the target's embedding where the head stores none (unregistered)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.midlayer.self_attn.kv_cache_spec()

    def from_target(self, aux: torch.Tensor) -> torch.Tensor:  # [T, 3Ht] -> [T, H]
        return self.fc(aux)

    def predict(self, positions: torch.Tensor, token_ids: torch.Tensor, previous: torch.Tensor,
                batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor:  # [T], [T], [T, H] -> [T, H]
        """`previous`: `from_target` of the target's aux hidden states, or the head's own output (chained)."""
        embedding = self.embed_tokens if self.embed_tokens is not None else self._target[0].model.embed_tokens
        return self.midlayer(positions, embedding(token_ids), previous, batch, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] fp32 (-inf off the draft vocabulary)
        draft = self.lm_head(self.norm(hidden)).float()                                          # [B, Vd]
        targets = torch.arange(draft.shape[-1], device=draft.device) + self.d2t                  # [Vd]
        full = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        full[:, targets] = draft
        return full
