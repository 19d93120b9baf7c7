"""DeepSeek-V4's multi-token-prediction (MTP) layer, `mtp.0.*` in DeepSeek's published names, as a drafter.

transformers' DeepSeek-V4 skips these tensors; the module here follows DeepSeek's design as its tensors lay it
out. At position p it reads the target's `hc_mult` residual streams s_p [n, H] as they enter the target's hyper
head (before it collapses them: `V4CausalLM.keep_streams`) and the token after p, and predicts the token at p + 2:

    e = e_proj(enorm(embed(t[p + 1])))                         [H]     (every position; no row is masked)
    x[j] = e + h_proj(hnorm(s_p[j]))  for each stream j        [n, H]
    y = block(x)                                               [n, H]  a V4 decoder block: hyper-connections,
                                                                       compressed attention, MoE (`V4DecoderLayer`)
    logits = head(norm(hc_head(y)))                            the layer's own hyper head (`hc_head_fn` ...)

Chained as a drafter, the streams y stand in for s at the next position (vLLM's and SGLang's rule for DeepSeek-V3's
MTP, here on the streams).

Which attention the block runs is not in transformers' config (its `layer_types` is cut to the target's layers),
so the tensors decide (`V4MtpTensors.attention_kind`): `attn.indexer.*` a compressed sparse attention (CSA) block,
`attn.compressor.*` alone a heavily compressed one (HCA), neither a sliding-window-only block (a legacy
`compress_ratios` entry past the target's layers, which transformers' config drops, would say the same). Likewise
`ffn.gate.tid2eid` makes its MoE hash-routed (on the token it embeds). `embed.weight`, `head.weight` and
`norm.weight` under the prefix are used where the checkpoint stores them, else the target's.

Like the target's layers it keeps per-sequence state (its window's keys, its compressors' carried projections) in
a state slot, in a `LayerCompressedCache` of its own at the sequence's slot index (moe_runtime/speculative/mtp.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.compressed_cache import CompressedAttentionSpec, LayerCompressedCache
from moe_runtime.layers.hyper_connections import HyperHead
from moe_runtime.layers.kv_compressor import WeightedNorm
from moe_runtime.layers.linear import Embedding, Linear
from moe_runtime.layers.v4_rotary import V4Rotary
from moe_runtime.models.decoder import BuildContext
from moe_runtime.models.deepseek_v4 import CSA, HCA, V4CausalLM, V4DecoderLayer, v4_attention, v4_moe

MTP_PREFIX = "mtp.0."
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class V4MtpTensors:
    """What the checkpoint stores for the MTP layer (names after `checkpoint_name`)."""

    attention_kind: str        # a `layer_types` entry: which attention the block runs (module doc)
    hashed: bool               # its MoE chooses experts by `tid2eid`
    own_embedding: bool
    own_head: bool
    own_norm: bool

    @classmethod
    def find(cls, names: set[str]) -> "V4MtpTensors":
        def has(prefix: str) -> bool:
            return any(name.startswith(MTP_PREFIX + prefix) for name in names)

        kind = CSA if has("attn.indexer.") else HCA if has("attn.compressor.") else SLIDING
        return cls(kind, f"{MTP_PREFIX}ffn.gate.tid2eid" in names, f"{MTP_PREFIX}embed.weight" in names,
                   f"{MTP_PREFIX}head.weight" in names, f"{MTP_PREFIX}norm.weight" in names)

    @staticmethod
    def present(names: set[str]) -> bool:
        return f"{MTP_PREFIX}e_proj.weight" in names


class V4MtpLayer(V4DecoderLayer):
    """The MTP block with its input projections and output head (module doc); parameters under `mtp.0.`."""

    def __init__(self, cfg, ctx: BuildContext, tensors: V4MtpTensors, target: V4CausalLM):
        rotaries = {label: V4Rotary(cfg, label, ctx.device) for label in ("main", "compress")}
        super().__init__(v4_attention(cfg, tensors.attention_kind, ctx, rotaries), v4_moe(cfg, tensors.hashed, ctx),
                         cfg, ctx.device)
        hidden = cfg.hidden_size
        self.n = cfg.hc_mult
        self.enorm = WeightedNorm(hidden, cfg.rms_norm_eps, ctx.device)
        self.hnorm = WeightedNorm(hidden, cfg.rms_norm_eps, ctx.device)
        self.e_proj = Linear(hidden, hidden, False, ctx.dtype, ctx.device)
        self.h_proj = Linear(hidden, hidden, False, ctx.dtype, ctx.device)
        self.hc_head = HyperHead(cfg.hc_mult, hidden, cfg.hc_eps, cfg.rms_norm_eps, ctx.device)
        self.norm = WeightedNorm(hidden, cfg.rms_norm_eps, ctx.device) if tensors.own_norm else None
        self.embed = Embedding(cfg.vocab_size, hidden, ctx.dtype, ctx.device) if tensors.own_embedding else None
        self.head = Linear(hidden, cfg.vocab_size, False, ctx.dtype, ctx.device) if tensors.own_head else None
        self._target = [target]        # its embedding, final norm and LM head where no copy is stored (unregistered)

    def kv_cache_spec(self) -> CompressedAttentionSpec:
        return self.attn.kv_cache_spec()

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:   # [T, n * H] (the kept streams) -> [T, n, H]
        return hidden.view(hidden.shape[0], self.n, hidden.shape[1] // self.n)

    def predict(self, positions: torch.Tensor, token_ids: torch.Tensor, previous: torch.Tensor,
                batch: AttentionBatch, cache: LayerCompressedCache) -> torch.Tensor:   # [T], [T], [T, n, H] -> same
        """The block's output streams at each row: `token_ids` are the tokens after each position, `previous` the
        streams there (the target's, or the previous MTP output when chained)."""
        embedding = self.embed if self.embed is not None else self._target[0].model.embed_tokens
        e = self.e_proj(self.enorm(embedding(token_ids)))                                       # [T, H]
        rows, n, hidden = previous.shape
        h = self.h_proj(self.hnorm(previous).reshape(rows * n, hidden)).view(rows, n, hidden)   # [T, n, H]
        return self(positions, h + e.unsqueeze(1), batch, cache, token_ids)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:   # [B, n, H] -> [B, V] fp32
        target = self._target[0]
        norm = self.norm if self.norm is not None else target.model.norm
        hidden = norm(self.hc_head(streams))                                                    # [B, H]
        if self.head is not None:
            return self.head(hidden).float()
        return target.logits(hidden)


class V4MtpCheckpointView(nn.Module):
    """Holds a `V4MtpLayer` under the checkpoint's names (mtp.0.*) for the weight loader."""

    def __init__(self, layer: V4MtpLayer):
        super().__init__()
        self.mtp = nn.ModuleDict({"0": layer})
