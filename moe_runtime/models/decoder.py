"""The decoder stack every architecture assembles: embed -> layers (attention + MLP) -> norm -> LM head.

Parameter names follow the HF checkpoints (model.layers.N.self_attn.q_proj.weight, ...), so weights
load by name; model files only choose which attention and MLP each layer gets.

One batch, eager or captured, runs the layers' plain `forward` (`_run`; an MoE block's is one
`MoEExecutor.run`). Only with two-batch overlap (`MoEExecutor.overlaps_micro_batches`) is the step
split by sequences into two micro-batches (moe_runtime/models/micro_batches.py) that run the layers'
staged form (`stages`, moe_runtime/moe/stages.py: an MoE block yields while its dispatch or combine
is in flight) interleaved, each computing while the other's transfer travels; their outputs are
concatenated back in order. With context parallelism
(moe_runtime/models/context_parallel.py) each rank of a DP worker runs its share of the step's rows and
the ranks gather the final hidden states back into step order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.kernels import KernelSet
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.models.context_parallel import ContextParallel
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Embedding, Linear
from moe_runtime.layers.norm import RMSNorm
from moe_runtime.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, gather_vocab_logits
from moe_runtime.models.micro_batches import MicroBatch, split_in_two
from moe_runtime.moe.dense_mlp import DenseMLP
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.moe.stages import Staged, call_staged, interleave
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.config.speculative import MODEL_DRAFTERS, SpeculativeConfig
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization, linear_quantization


@dataclass
class BuildContext:
    """What model builders need besides the HF config: where and how layers run."""

    kernels: KernelSet
    executor: MoEExecutor   # every MoE layer registers its experts with it and runs through it
    parallel: ParallelContext
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    quant: WeightQuantization | None = None   # --quantization fp8 | int8: projections and experts stay quantized
    engine: EngineConfig | None = None        # the engine's settings, for a model that refuses some by name

    def owns_layer(self, index: int) -> bool:
        """Whether this pipeline stage holds decoder layer `index`."""
        span = self.parallel.stage_layers
        return span is None or span[0] <= index < span[1]

    def embeds_on_last_stage(self, tie_word_embeddings: bool) -> bool:
        """Whether the last pipeline stage holds the embedding too: tied to the LM head, or read by the model
        drafter (the checkpoint's MTP layer, an EAGLE-3 head that stores none of its own), which drafts there
        (`speculative/pipeline_drafts.py`)."""
        config = SpeculativeConfig.parse(self.engine.speculative_config) if self.engine is not None else None
        return tie_word_embeddings or (config is not None and config.method in MODEL_DRAFTERS)

    def dense_tp(self) -> dict:
        """Tensor-parallel arguments for a dense MLP (split only when the model runs dense TP)."""
        p = self.parallel
        return dict(tp_size=p.attn_tp_size, tp_rank=p.attn_tp_rank, tp_group=p.attn_tp_group) if p.dense_tp else {}

    @property
    def linear_quant(self) -> WeightQuantization | None:
        """The format of the layers that are not routed experts (attention, dense MLPs): the kept format, or the
        compute dtype under a format that keeps only experts (MXFP4)."""
        return linear_quantization(self.quant)

    def dense_mlp(self, hidden_size: int, intermediate_size: int) -> DenseMLP:
        """A dense layer's MLP (split under dense tensor parallelism, quantized when weights are kept quantized)."""
        return DenseMLP(hidden_size, intermediate_size, self.kernels, self.dtype, self.device,
                        quant=self.linear_quant, **self.dense_tp())


class MissingLayer(nn.Module):
    """Stands for a decoder layer another pipeline stage holds (keeps the global layer indices)."""


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, ctx: BuildContext,
                 mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps, ctx.kernels, ctx.dtype, ctx.device)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, ctx.kernels, ctx.dtype, ctx.device)

    def forward(self, positions, x, batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor:  # [T, H]
        """The layer in one go (no yield points): what one batch runs, and what a captured decode step traces."""
        x = x + self.self_attn(positions, self.input_layernorm(x), batch, cache)
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))

    def stages(self, positions, x, batch: AttentionBatch, cache: LayerKVCache) -> Staged[torch.Tensor]:  # [T, H]
        """`forward` as a staged computation for two-batch overlap, yielding while the MoE block's transfers are in
        flight."""
        x = x + self.self_attn(positions, self.input_layernorm(x), batch, cache)
        mlp_out = yield from call_staged(getattr(self, self.mlp_name), self.post_attention_layernorm(x))
        return x + mlp_out


class DecoderStack(nn.Module):
    """Embedding, the decoder layers this stage holds, final norm (first/last pipeline stage only)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], eps: float, ctx: BuildContext,
                 tie_word_embeddings: bool = False):
        super().__init__()
        p = ctx.parallel
        self.embed_tokens = None
        if p.is_first_stage or (p.is_last_stage and ctx.embeds_on_last_stage(tie_word_embeddings)):
            if p.dense_tp:
                self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, p.attn_tp_size, p.attn_tp_rank,
                                                           p.attn_tp_group, ctx.dtype, ctx.device)
            else:
                self.embed_tokens = Embedding(vocab_size, hidden_size, ctx.dtype, ctx.device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps, ctx.kernels, ctx.dtype, ctx.device) if p.is_last_stage else None

    def owned_layers(self) -> list[nn.Module]:
        """The layers this stage runs (computed once: the forward pass asks every step)."""
        if not hasattr(self, "_owned"):
            self._owned = [layer for layer in self.layers if not isinstance(layer, MissingLayer)]
        return self._owned


def build_stack(cfg, ctx: BuildContext, make_layer) -> DecoderStack:
    """The stack with the layers this stage owns built by `make_layer(index)`, the others missing."""
    layers = [make_layer(i) if ctx.owns_layer(i) else MissingLayer() for i in range(cfg.num_hidden_layers)]
    return DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, ctx, cfg.tie_word_embeddings)


class CausalLM(nn.Module):
    """`forward` maps a flattened batch of new tokens to final hidden states; `logits` projects them."""

    def __init__(self, hf_config, stack: DecoderStack, tie_word_embeddings: bool, ctx: BuildContext):
        super().__init__()
        p = ctx.parallel
        self.hf_config = hf_config
        self.model = stack
        self.tied = tie_word_embeddings
        self.lm_head = None
        self.parallel = p
        self.executor = ctx.executor   # says whether a step runs as two overlapped micro-batches
        self.lm_matmul = ctx.kernels.linear_rows
        self.context_parallel = ContextParallel(p.cp_size, p.cp_rank, p.cp_group) if p.cp_size > 1 else None
        vocab, hidden = hf_config.vocab_size, hf_config.hidden_size
        if p.is_last_stage and p.dense_tp and not tie_word_embeddings:
            self.lm_head = ParallelLMHead(vocab, hidden, p.attn_tp_size, p.attn_tp_rank, p.attn_tp_group,
                                          ctx.dtype, ctx.device)
        elif p.is_last_stage and not tie_word_embeddings:
            self.lm_head = Linear(hidden, vocab, False, ctx.dtype, ctx.device)
        # an EAGLE-3 head reads the residual stream entering these layers (moe_runtime/models/eagle3.py, global
        # layer indices): the last eager forward's, concatenated in layer order [T, len * H] (none kept when
        # empty); under pipeline parallelism each stage keeps those of its own layers and hands them on with its
        # activations, so that the last stage holds all of them (`stage_activation_width`)
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.model.owned_layers())

    @property
    def first_layer(self) -> int:
        """The global index of this stage's first decoder layer."""
        span = self.parallel.stage_layers
        return span[0] if span is not None else 0

    def min_sliding_window(self) -> int | None:
        """The narrowest sliding window among this stage's attention layers (None: all see the whole context;
        MLA layers have none)."""
        windows = [getattr(layer.self_attn.shape, "sliding_window", None) for layer in self.model.owned_layers()]
        return min((window for window in windows if window is not None), default=None)

    def stage_activation_width(self) -> int:
        """Channels per token this pipeline stage receives from the previous one: the residual stream, then the
        aux layers' inputs that earlier stages kept for an EAGLE-3 head ([t, H] each, in layer order)."""
        carried = sum(1 for layer in self.aux_layers if layer < self.first_layer)
        return self.hf_config.hidden_size * (1 + carried)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.self_attn.kv_cache_spec() for layer in self.model.owned_layers()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                caches: list[LayerKVCache], hidden: torch.Tensor | None = None) -> torch.Tensor:  # [T] -> [T, H]
        """Final hidden states, or, on a pipeline stage that is not the last, this stage's activations
        (`hidden` carries the previous stage's; the first stage embeds `input_ids`). Keeps the aux layers' inputs
        in `aux_hidden`, in the step's row order."""
        if self.context_parallel is not None:
            split = self.context_parallel.plan(batch)
            mine = MicroBatch(input_ids.index_select(0, split.rows), positions.index_select(0, split.rows),
                              split.local_batch, None if hidden is None else hidden.index_select(0, split.rows))
            out = split.gather(self._run(mine, caches))                                # [t, H] -> [T, H]
            self.aux_hidden = mine.aux_hidden                                          # this rank's rows only
            return out
        if not self.executor.overlaps_micro_batches():
            whole = MicroBatch(input_ids, positions, batch, hidden)
            out = self._run(whole, caches)
            self.aux_hidden = whole.aux_hidden
            return out
        # Two-batch overlap: every rank splits, also into two empty halves, and runs the same interleaving,
        # so the EP group's collectives pair up.
        first, second = split_in_two(input_ids, positions, batch, hidden)
        out_first, out_second = interleave(self._stages(first, caches), self._stages(second, caches))
        self.aux_hidden = None if first.aux_hidden is None else \
            torch.cat([first.aux_hidden, second.aux_hidden])                         # [T, len(aux_layers) * H]
        return torch.cat([out_first, out_second])                                   # [T, H]

    def drafter_hidden(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H']
        """What a drafter reads of the last forward, whose final hidden states are `hidden`: the aux layers'
        inputs where an EAGLE-3 head asked for them ([T, 3H]), else `hidden` itself (MTP)."""
        return self.aux_hidden if self.aux_layers else hidden

    def _run(self, micro: MicroBatch, caches: list[LayerKVCache]) -> torch.Tensor:  # -> [t, H]
        """One batch through this stage's layers, no yield points (generators are also opaque to torch.compile,
        which traces this for a captured decode step)."""
        x, aux = self._stage_input(micro)
        for index, (layer, cache) in enumerate(zip(self.model.owned_layers(), caches), self.first_layer):
            if index in self.aux_layers:
                aux.append(x)
            x = layer(micro.positions, x, micro.batch, cache)
        return self._stage_output(micro, x, aux)

    def _stages(self, micro: MicroBatch, caches: list[LayerKVCache]) -> Staged[torch.Tensor]:  # -> [t, H]
        """`_run` as a staged computation, for two micro-batches interleaved (two-batch overlap only)."""
        x, aux = self._stage_input(micro)
        for index, (layer, cache) in enumerate(zip(self.model.owned_layers(), caches), self.first_layer):
            if index in self.aux_layers:
                aux.append(x)
            x = yield from layer.stages(micro.positions, x, micro.batch, cache)
        return self._stage_output(micro, x, aux)

    def _stage_input(self, micro: MicroBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The residual stream entering this stage [t, H] (the first embeds the tokens), and the aux layers'
        inputs earlier stages kept ([t, H] each, `stage_activation_width`)."""
        if self.parallel.is_first_stage:
            return self.model.embed_tokens(micro.input_ids), []
        x, *aux = micro.hidden.split(self.hf_config.hidden_size, dim=-1)
        return x.contiguous(), aux

    def _stage_output(self, micro: MicroBatch, x: torch.Tensor,
                      aux: list[torch.Tensor]) -> torch.Tensor:  # [t, H] -> [t, H or more]
        """The last stage's final hidden states (the aux layers' inputs kept as the micro-batch's `aux_hidden`);
        another stage's residual stream with the aux layers' inputs kept so far beside it, for the next stage."""
        if not self.parallel.is_last_stage:
            return torch.cat([x, *aux], dim=-1) if aux else x
        micro.aux_hidden = torch.cat(aux, dim=-1) if aux else None                    # [t, len(aux_layers) * H]
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] fp32
        if self.parallel.dense_tp:
            return gather_vocab_logits(hidden, self.model.embed_tokens if self.tied else self.lm_head)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.lm_matmul(hidden, weight).float()
