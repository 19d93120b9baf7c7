"""What the recurrent layers of a model run through transformers keep per sequence: the state layout, from its config.

transformers (5.x) keeps the state of a Mamba, Mamba2, short-convolution, Gated DeltaNet, KDA or lightning layer in
its cache object: a `LinearAttentionLayer` (or a hybrid layer that is also attention) holds, per state index, a
convolution state [B, channels, kernel] and a recurrent state of the mixer's own shape; MiniMax keeps its lightning
layers' [B, heads, D, D] in `MiniMaxCache.linear_cache`. Which layers keep one is transformers' own reading of the
config (`get_layer_types_and_kwargs`: a layer type whose cache class is a linear-attention one). The shapes are not
in the cache classes, only in each mixer's code, so they are written here per model type (`_SHAPES`, checked
against the states transformers builds in tests/test_transformers_backend_recurrent.py); a model type whose
recurrent layers are not listed is refused by name.

In our state cache (moe_runtime/layers/state_cache.py) a layer's parts are packed flat, in float32, into the
`ssm` row of its slot (the `conv` tensor is left empty): one `StateSpec` shape for every layer (the largest
layer's), so slots, prefix-cache snapshots, KV tiers and P/D transfers handle these layers as they handle Gated
DeltaNet's. float32 holds a bf16 state exactly, so a state read back into transformers in its own dtype
(`RecurrentStateBridge`, recurrent_bridge.py) is the one it left.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin,
                                      get_layer_types_and_kwargs)

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.state_cache import StateSpec

CONV = "conv"
RECURRENT = "recurrent"
ATTENTION_AND_STATE = ("hybrid", "hybrid_sliding")   # transformers' layer types of attention with a state beside
MIXERLESS = ("moe", "mlp")                           # ... of a block with no token mixer (Nemotron-H)


class UnsupportedRecurrentModel(UnsupportedArchitectureError):
    """A model whose recurrent layers this backend cannot keep in the state cache (the reason names the layer)."""


@dataclass(frozen=True)
class StatePart:
    """One tensor transformers keeps for one sequence in one layer: `kind` CONV or RECURRENT, at state index
    `index` (a layer may keep several: Inkling's four convolutions)."""

    kind: str
    index: int
    shape: tuple[int, ...]            # per sequence, no batch dimension
    # transformers' dtype for it where not the model's (the SSM and delta-rule states are fp32 in a bf16 model): what
    # a state is read back as before transformers itself left one in this process (a P/D transfer's)
    dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LayerState:
    layer: int                        # the decoder layer's index (transformers' layer_idx)
    parts: tuple[StatePart, ...]

    @property
    def numel(self) -> int:
        return sum(part.numel for part in self.parts)

    def offsets(self) -> list[int]:
        """Where each part starts in the layer's packed row."""
        starts, at = [], 0
        for part in self.parts:
            starts.append(at)
            at += part.numel
        return starts


@dataclass(frozen=True)
class RecurrentLayout:
    """Every recurrent layer of a model and how transformers' code treats its state."""

    model_type: str
    num_layers: int                   # the decoder's (transformers' cache has one layer per decoder layer)
    layers: tuple[LayerState, ...]
    # the states live in `MiniMaxCache.linear_cache` (MiniMax's lightning attention), not in linear cache layers
    linear_cache: bool = False
    # the mixer's multi-token scan starts from zeros whatever the cache holds (Jamba's Mamba): a continued chunk
    # runs its recurrence token by token instead (transformers' past-recording path, which starts from the state)
    scan_ignores_state: bool = False
    # the recurrent layers that are attention layers too (ZAYA's CCA, Inkling's convolved K/V): a KV cache and a state
    attention_layers: tuple[int, ...] = ()
    # layers with no token mixer at all (Nemotron-H's "moe" / "mlp" blocks): they keep nothing per token
    mixerless_layers: tuple[int, ...] = ()

    @property
    def layer_indices(self) -> tuple[int, ...]:
        return tuple(state.layer for state in self.layers)

    def state_spec(self) -> StateSpec:
        """The one slot shape every recurrent layer is packed into: the largest layer's parts, flat, float32."""
        return StateSpec(conv_channels=0, conv_width=0, num_heads=1, key_dim=1,
                         value_dim=max(state.numel for state in self.layers))

    def with_state_specs(self, specs: list) -> list:
        """A model's per-layer cache specs (one per decoder layer) with each recurrent layer's state slot: in place of
        a recurrent layer's, and after the decoder's layers for an attention layer that keeps a state too (its paged
        KV cache stays at its index; `cache_index` says where its state is). A layer without a token mixer keeps a KV
        spec of no heads: no bytes of the budget, an empty cache tensor."""
        states = [self.state_spec() if i in self.layer_indices and i not in self.attention_layers else
                  dataclasses.replace(spec, num_kv_heads=0, total_kv_heads=0) if i in self.mixerless_layers else spec
                  for i, spec in enumerate(specs)]
        return states + [self.state_spec() for _ in self.attention_layers]

    def cache_index(self, layer: int) -> int:
        """Where `layer`'s state cache is among the model's caches (`with_state_specs`' order)."""
        if layer in self.attention_layers:
            return self.num_layers + self.attention_layers.index(layer)
        return layer

    def of_layer(self, layer: int) -> LayerState:
        for state in self.layers:
            if state.layer == layer:
                return state
        raise KeyError(f"layer {layer} keeps no recurrent state")

    @classmethod
    def of(cls, hf_config) -> "RecurrentLayout | None":
        """The layout of `hf_config`'s model (its text config's), None if no layer keeps a recurrent state."""
        cfg = hf_config.get_text_config(decoder=True)
        layers = recurrent_layers(cfg)
        if not layers:
            return None
        model_type = cfg.model_type
        shapes = _SHAPES.get(model_type)
        if shapes is None:
            raise UnsupportedRecurrentModel(
                f"model type {model_type!r}: layers {list(layers)} keep a recurrent state "
                f"({type_of(cfg, layers[0])!r} layers) whose shape the transformers backend does not know; "
                f"supported: {sorted(_SHAPES)}")
        raw_types = getattr(cfg, "layer_types", None) or ()
        return cls(model_type, cfg.num_hidden_layers, tuple(LayerState(i, shapes(cfg, i)) for i in layers),
                   linear_cache=model_type == "minimax", scan_ignores_state=model_type == "jamba",
                   attention_layers=tuple(i for i in layers if type_of(cfg, i) in ATTENTION_AND_STATE),
                   mixerless_layers=tuple(i for i, kind in enumerate(raw_types) if kind in MIXERLESS))


def served_layout(hf_config) -> RecurrentLayout | None:
    """The layout the transformers backend serves (None: no recurrent layer); recurrent layers of unknown shape are
    refused by name (`RecurrentLayout.of`)."""
    return RecurrentLayout.of(hf_config)


def recurrent_layers(cfg) -> tuple[int, ...]:
    """The layers transformers gives a linear-attention cache layer (a convolution and/or recurrent state), plus
    MiniMax's lightning layers (kept in its own cache class)."""
    layer_types, _ = get_layer_types_and_kwargs(cfg)
    return tuple(i for i, kind in enumerate(layer_types)
                 if issubclass(DYNAMIC_LAYER_TYPE_MAPPING.get(kind, object), LinearAttentionCacheLayerMixin))


def type_of(cfg, layer: int) -> str:
    return get_layer_types_and_kwargs(cfg)[0][layer]


# ---- per model type: the parts one recurrent layer keeps (read off each mixer's code in transformers 5.25) ----

def _mamba(cfg, layer: int) -> tuple[StatePart, ...]:
    """Jamba's Mamba: conv over x [expand * hidden, d_conv]; selective-scan state [expand * hidden, d_state]."""
    inner = cfg.mamba_expand * cfg.hidden_size
    return (StatePart(CONV, 0, (inner, cfg.mamba_d_conv)),
            StatePart(RECURRENT, 0, (inner, cfg.mamba_d_state), torch.float32))


def _mamba2(heads: str, head_dim: str, state: str, groups: str, kernel: str, ssm_dtype: str | None = None):
    """Mamba2: conv over [x, B, C] [H * P + 2 * G * N, K]; SSM state [H, P, N]."""
    def parts(cfg, layer: int) -> tuple[StatePart, ...]:
        h, p, n, g, k = (getattr(cfg, name) for name in (heads, head_dim, state, groups, kernel))
        named = getattr(cfg, ssm_dtype, None) if ssm_dtype else None
        dtype = getattr(torch, named) if isinstance(named, str) else torch.float32
        return (StatePart(CONV, 0, (h * p + 2 * g * n, k)), StatePart(RECURRENT, 0, (h, p, n), dtype))
    return parts


def _gated_deltanet(cfg, layer: int) -> tuple[StatePart, ...]:
    """Gated DeltaNet: conv over [q, k, v] [2 * nk * dk + nv * dv, K]; delta-rule state [nv, dk, dv]."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return (StatePart(CONV, 0, (2 * nk * dk + nv * dv, cfg.linear_conv_kernel_dim)),
            StatePart(RECURRENT, 0, (nv, dk, dv), torch.float32))


def _kimi_delta(cfg, layer: int) -> tuple[StatePart, ...]:
    """KDA (Kimi Linear, Bailing hybrid): conv over [q, k, v] [3 * H * D, K]; delta-rule state [H, D, D]."""
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return (StatePart(CONV, 0, (3 * h * d, cfg.linear_conv_kernel_dim)),
            StatePart(RECURRENT, 0, (h, d, d), torch.float32))


def _short_conv(cfg, layer: int) -> tuple[StatePart, ...]:
    """LFM2's gated short convolution: conv over B * x [hidden, L_cache]; no recurrent state."""
    return (StatePart(CONV, 0, (cfg.hidden_size, cfg.conv_L_cache)),)


def _lightning(cfg, layer: int) -> tuple[StatePart, ...]:
    """MiniMax's lightning attention: the decayed K^T V sum [heads, D, D]."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (StatePart(RECURRENT, 0, (cfg.num_attention_heads, d, d)),)


def _zaya(cfg, layer: int) -> tuple[StatePart, ...]:
    """ZAYA's compressed convolutional attention: conv over [q, k] [(H + KV) * D, (t0 - 1) + (t1 - 1)], and the
    previous token's delayed value projection [KV * D / 2]."""
    d = cfg.head_dim
    width = (cfg.cca_time0 - 1) + (cfg.cca_time1 - 1)
    return (StatePart(CONV, 0, ((cfg.num_attention_heads + cfg.num_key_value_heads) * d, width)),
            StatePart(RECURRENT, 0, (cfg.num_key_value_heads * d // 2,)))


def _inkling(cfg, layer: int) -> tuple[StatePart, ...]:
    """Inkling's attention layers convolve their keys (state 0) and values (1) [KV * D, sconv kernel] and the
    layer's attention (2) and MLP (3) outputs [hidden, conv kernel], all in float32 (transformers keeps the
    convolutions in fp32 whatever the model's dtype)."""
    sliding = type_of(cfg, layer) == "hybrid_sliding"
    kv = cfg.swa_num_key_value_heads * cfg.swa_head_dim if sliding else cfg.num_key_value_heads * cfg.head_dim
    kernel = getattr(cfg, "sconv_kernel_size", None) or cfg.conv_kernel_size
    f32 = torch.float32
    return (StatePart(CONV, 0, (kv, kernel), f32), StatePart(CONV, 1, (kv, kernel), f32),
            StatePart(CONV, 2, (cfg.hidden_size, cfg.conv_kernel_size), f32),
            StatePart(CONV, 3, (cfg.hidden_size, cfg.conv_kernel_size), f32))


_SHAPES = {
    "jamba": _mamba,
    "nemotron_h": _mamba2("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                          "mamba_ssm_cache_dtype"),
    "granitemoehybrid": _mamba2("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
    "qwen3_next": _gated_deltanet,
    "qwen3_5_moe_text": _gated_deltanet,
    "qwen4_exp_text": _gated_deltanet,
    "lara_mini": _gated_deltanet,
    "kimi_linear": _kimi_delta,
    "bailing_hybrid": _kimi_delta,
    "lfm2_moe": _short_conv,
    "minimax": _lightning,
    "zaya": _zaya,
    "inkling_text": _inkling,
}
