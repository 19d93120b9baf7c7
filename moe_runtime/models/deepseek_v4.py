"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): compressed attention, hyper-connected residual streams, hash-routed MoE.

- Attention (moe_runtime/layers/compressed_attention.py), per `layer_types`: a sliding window on every layer, plus
  compressed sparse attention (CSA: an entry per 4 tokens, a lightning indexer choosing `index_topk` of them per
  query) or heavily compressed attention (HCA: an entry per 128 tokens, all read); sinks, a grouped low-rank output
  projection. Its cache (moe_runtime/layers/compressed_cache.py) pages the entries and keeps the window and the
  compressors' partial windows as per-sequence state.
- The residual is `hc_mult` streams mixed by hyper-connections around each block (moe_runtime/layers/
  hyper_connections.py), collapsed by the hyper head before the final norm.
- MoE on every layer: `sqrtsoftplus` scores, DeepSeek-V3's correction bias for the choice, top-k always
  renormalised and scaled; the first layers (`mlp_layer_types` "hash_moe") choose their experts by a frozen
  token id -> experts table (`tid2eid`) instead. Experts and the shared expert run a clamped SwiGLU (`swiglu_limit`).
- The multi-token-prediction layer (`mtp.0.*`) drafts for speculative decoding (moe_runtime/models/deepseek_v4_mtp.py);
  without method "mtp" its tensors are skipped by name.

Checkpoints: the names DeepSeek publishes (`layers.N.attn.wq_a.weight`, `embed.weight`, `head.weight`,
`hc_head_fn`, ...), with or without transformers' `model.` prefix (`checkpoint_name` maps them to this module
tree). As released: FP8 block linears (`<linear>.scale`, e8m0 block scales) and FP4 routed experts
(moe_runtime/weights/quantization/deepseek_fp4_format.py), dequantized at load; `--quantization mxfp4` keeps the
experts' FP4 bytes, which are MXFP4's layout.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from moe_runtime.kernels import RoutingConfig, TopK
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.kernels.routing import chosen_weights, expert_scores
from moe_runtime.models.micro_batches import MicroBatch
from moe_runtime.layers.compressed_attention import CompressedAttention, V4AttentionShape
from moe_runtime.layers.hyper_connections import HyperConnection, HyperHead
from moe_runtime.layers.kv_compressor import WeightedNorm
from moe_runtime.layers.v4_indexer import IndexerShape, V4Indexer
from moe_runtime.layers.v4_rotary import V4Rotary
from moe_runtime.models.decoder import BuildContext, CausalLM, build_stack
from moe_runtime.models.deepseek_v4_support import refuse_unsupported
from moe_runtime.moe.expert_weights import MIXTRAL_NAMING
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.moe.router import Router
from moe_runtime.moe.stages import Staged
from moe_runtime.config.speculative import SpeculativeConfig
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import copy_checked

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE = "hash_moe"


class HashRouter(Router):
    """The router of a hash layer: its logits score the experts its `tid2eid` row names for the token."""

    def __init__(self, hidden_size: int, num_experts: int, vocab_size: int, top_k: int, dtype, device):
        super().__init__(hidden_size, num_experts, False, dtype, device)
        self.tid2eid = nn.Parameter(torch.zeros(vocab_size, top_k, dtype=torch.long, device=device),
                                    requires_grad=False)

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        loaded = super().load_weights(reader, prefix)
        copy_checked(self.tid2eid, reader.read(f"{prefix}tid2eid"), f"{prefix}tid2eid", reader.directory)
        return loaded | {"tid2eid"}


class V4MoE(SparseMoE):
    """SparseMoE whose choice may depend on the token ids (hash layers: `router.tid2eid`)."""

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:   # [T, H] -> [T, H]
        return self._add_shared(x, self._executor.run(self.moe_layer, x, self._choose(x, input_ids)))

    def stages(self, x: torch.Tensor, input_ids: torch.Tensor) -> Staged[torch.Tensor]:
        out = yield from self._executor.stages(self.moe_layer, x, self._choose(x, input_ids))
        return self._add_shared(x, out)

    def _choose(self, x: torch.Tensor, input_ids: torch.Tensor) -> TopK:
        """A hash layer's choice: the table's ids, weighed by the gate's scores at them (gathered, renormalised,
        scaled: `chosen_weights`, the rule routing replay weighs forced ids by, so a forced row replaces the
        table's ids as on any other layer)."""
        router = getattr(self, self.router_name)
        if not isinstance(router, HashRouter):
            return self._route(x)
        logits = router(x)                                                                   # [T, E] fp32
        ids = router.tid2eid[input_ids]                                                      # [T, K]
        weights = chosen_weights(expert_scores(logits, self.routing.scoring), ids, self.routing)
        return self._replayed(logits, TopK(weights=weights, ids=ids))


class V4DecoderLayer(nn.Module):
    def __init__(self, attn: CompressedAttention, ffn: V4MoE, cfg, device):
        super().__init__()
        self.attn, self.ffn = attn, ffn
        self.attn_norm = WeightedNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.ffn_norm = WeightedNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        hc = dict(hc_mult=cfg.hc_mult, hidden_size=cfg.hidden_size, sinkhorn_iters=cfg.hc_sinkhorn_iters,
                  hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, device=device)
        self.hc_attn, self.hc_ffn = HyperConnection(**hc), HyperConnection(**hc)

    def _attention(self, positions, streams, batch, cache) -> torch.Tensor:   # [T, n, H] -> [T, n, H]
        post, comb, x = self.hc_attn(streams)
        return HyperConnection.merge(streams, self.attn(positions, self.attn_norm(x), batch, cache), post, comb)

    def forward(self, positions, streams, batch, cache, input_ids) -> torch.Tensor:   # [T, n, H]
        streams = self._attention(positions, streams, batch, cache)
        post, comb, x = self.hc_ffn(streams)
        return HyperConnection.merge(streams, self.ffn(self.ffn_norm(x), input_ids), post, comb)

    def stages(self, positions, streams, batch, cache, input_ids) -> Staged[torch.Tensor]:
        streams = self._attention(positions, streams, batch, cache)
        post, comb, x = self.hc_ffn(streams)
        out = yield from self.ffn.stages(self.ffn_norm(x), input_ids)
        return HyperConnection.merge(streams, out, post, comb)


class V4CausalLM(CausalLM):
    """Runs the residual as `hc_mult` streams and hands each MoE layer the step's token ids."""

    def kv_cache_specs(self) -> list:
        return [layer.attn.kv_cache_spec() for layer in self.model.owned_layers()]

    def min_sliding_window(self) -> int | None:
        return None   # the window lives in per-sequence state, not in the paged blocks

    @staticmethod
    def checkpoint_name(stored: str) -> str:
        return checkpoint_name(stored)

    def stage_activation_width(self) -> int:
        return self.hf_config.hc_mult * self.hf_config.hidden_size   # the streams, flattened

    def _streams(self, micro: MicroBatch) -> torch.Tensor:   # -> [t, n, H]
        n, hidden = self.hf_config.hc_mult, self.hf_config.hidden_size
        if not self.parallel.is_first_stage:
            return micro.hidden.view(micro.hidden.shape[0], n, hidden)
        return self.model.embed_tokens(micro.input_ids).unsqueeze(1).expand(-1, n, -1).contiguous()

    def keep_streams(self) -> None:
        """From now on keep each eager forward's `hc_mult` streams entering the hyper head, flattened, as
        `aux_hidden` [T, n * H] (what the MTP layer reads: moe_runtime/models/deepseek_v4_mtp.py). They are the
        residual entering layer `num_hidden_layers`, so `aux_layers` names that one (the runner keeps
        `aux_hidden` where `aux_layers` is set)."""
        self.aux_layers = (self.hf_config.num_hidden_layers,)

    def _keeps_streams(self) -> bool:
        return self.parallel.is_last_stage and self.aux_layers == (self.hf_config.num_hidden_layers,)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, caches: list,
                hidden: torch.Tensor | None = None) -> torch.Tensor:   # [T] -> [T, H]
        out = super().forward(input_ids, positions, batch, caches, hidden)
        if not self._keeps_streams():
            return out
        # `_output` put the streams beside the final hidden states, so that every path (two-batch overlap's halves
        # included) hands them through in row order
        width = self.hf_config.hidden_size
        self.aux_hidden = out[:, width:]                                                 # [T, n * H]
        return out[:, :width].contiguous()

    def _output(self, streams: torch.Tensor) -> torch.Tensor:   # [t, n, H] -> [t, H], or [t, n * H] mid-pipeline
        if not self.parallel.is_last_stage:
            return streams.reshape(streams.shape[0], self.stage_activation_width())
        final = self.model.norm(self.model.hc_head(streams))
        if self._keeps_streams():
            return torch.cat([final, streams.reshape(streams.shape[0], self.stage_activation_width())], dim=-1)
        return final

    def _run(self, micro: MicroBatch, caches: list) -> torch.Tensor:
        streams = self._streams(micro)
        for layer, cache in zip(self.model.owned_layers(), caches):
            streams = layer(micro.positions, streams, micro.batch, cache, micro.input_ids)
        return self._output(streams)

    def _stages(self, micro: MicroBatch, caches: list) -> Staged[torch.Tensor]:
        streams = self._streams(micro)
        for layer, cache in zip(self.model.owned_layers(), caches):
            streams = yield from layer.stages(micro.positions, streams, micro.batch, cache, micro.input_ids)
        return self._output(streams)


_LEAF_RENAMES = (   # DeepSeek's published names (and transformers' saved ones) -> this module tree's
    (r"\.scale$", ".weight_scale_inv"),   # a released linear's block scales (`hc_*_scale` are parameters, not these)
    (r"^(model\.)?embed(_tokens)?\.weight$", "model.embed_tokens.weight"),
    (r"^(lm_)?head\.weight$", "lm_head.weight"),
    (r"^(model\.)?norm\.weight$", "model.norm.weight"),
    (r"^(model\.)?hc_head[._](hc_)?(fn|base|scale)$", r"model.hc_head.\3"),
    (r"^(mtp\.\d+\.)hc_head[._](hc_)?(fn|base|scale)$", r"\1hc_head.\3"),   # the MTP layer's own hyper head
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2"),
    (r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"^layers\.", "model.layers."),
)


def checkpoint_name(stored: str) -> str:
    """The parameter name a stored DeepSeek-V4 tensor fills (the multi-token-prediction layer's `mtp.N.*` keep their
    prefix: moe_runtime/models/deepseek_v4_mtp.py)."""
    name = stored
    for pattern, replacement in _LEAF_RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def v4_attention(cfg, kind: str, ctx: BuildContext, rotaries: dict[str, V4Rotary]) -> CompressedAttention:
    """An attention block of `kind` (a `layer_types` entry), as the target's layers and the MTP layer build it."""
    rate = cfg.compress_rates[kind] if kind in (CSA, HCA) else 0
    shape = V4AttentionShape(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                             cfg.o_lora_rank, cfg.sliding_window, rate, kind == CSA, cfg.rms_norm_eps,
                             draft_slack(ctx.engine))
    indexer = None
    if kind == CSA:
        indexer = V4Indexer(IndexerShape.from_config(cfg), cfg.rms_norm_eps, rotaries["compress"], ctx.dtype,
                            ctx.device, ctx.linear_quant)
    rotary = rotaries["compress" if rate else "main"]
    p = ctx.parallel
    return CompressedAttention(shape, rotary, rotaries["compress"], indexer, ctx.dtype, ctx.device, ctx.linear_quant,
                               p.attn_tp_size, p.attn_tp_rank, p.attn_tp_group)


def draft_slack(engine) -> int:
    """Ring positions kept past the window and the carried windows: a verify step's 1 + k tokens, so that the
    positions a rejected draft wrote never overwrite one a later step reads."""
    speculative = SpeculativeConfig.parse(engine.speculative_config) if engine is not None else None
    return 0 if speculative is None else speculative.num_speculative_tokens + 1


def v4_moe(cfg, hashed: bool, ctx: BuildContext) -> V4MoE:
    """A MoE block (`hashed`: chosen by its `tid2eid` table), as the target's layers and the MTP layer build it."""
    activation = ExpertActivation.deepseek_v4(cfg.swiglu_limit)
    shape = MoEShape(cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size,
                     shared_intermediate_size=cfg.moe_intermediate_size, shared_name="shared_experts",
                     correction_bias=not hashed, activation=activation, shared_activation=activation)
    routing = RoutingConfig(top_k=cfg.num_experts_per_tok, scoring=cfg.scoring_func, renormalize=True,
                            routed_scaling_factor=cfg.routed_scaling_factor)
    moe = V4MoE(shape, routing, ctx.executor, ctx.kernels, MIXTRAL_NAMING, dtype=ctx.dtype, device=ctx.device,
                quant=ctx.quant)
    if hashed:
        moe.gate = HashRouter(cfg.hidden_size, cfg.n_routed_experts, cfg.vocab_size, cfg.num_experts_per_tok,
                              ctx.dtype, ctx.device)
    return moe


def build_deepseek_v4(cfg, ctx: BuildContext) -> V4CausalLM:
    refuse_unsupported(cfg, ctx)
    rotaries = {label: V4Rotary(cfg, label, ctx.device) for label in ("main", "compress")}

    def make_layer(i: int) -> V4DecoderLayer:
        return V4DecoderLayer(v4_attention(cfg, cfg.layer_types[i], ctx, rotaries),
                              v4_moe(cfg, cfg.mlp_layer_types[i] == HASH_MOE, ctx), cfg, ctx.device)

    stack = build_stack(cfg, ctx, make_layer)
    if ctx.parallel.is_last_stage:
        stack.norm = WeightedNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.device)
        stack.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps, ctx.device)
    return V4CausalLM(cfg, stack, cfg.tie_word_embeddings, ctx)
