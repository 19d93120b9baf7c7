"""Append a multi-token-prediction (MTP) layer to a checkpoint, named as the published ones name it: what the tests
and the speculative-decoding bench load when no published checkpoint fits on the machine.

DeepSeek-V4: `mtp.0.*` in DeepSeek's names, the block drawn from one of the target's layers (which decides its
attention kind), `e_proj` / `h_proj` and the norms at random, a hyper head of its own. DeepSeek-V3, GLM-4.5,
DeepSeek-V3.2 and GLM-5: layer N = num_hidden_layers, a decoder block drawn from the last one's tensors (GLM-5's
from the last layer with an indexer of its own: `mtp_block_layer`), `enorm` / `hnorm` / `shared_head.norm` and
`eh_proj` at random; with `own_copies`, the embedding and LM head copies
DeepSeek-V3's files carry too (`embed_tokens`, `shared_head.head`). Qwen3-Next / Qwen3.5-MoE (a config with
linear-attention layers): `mtp.layers.0` drawn from the last full-attention layer, `mtp.fc`, `mtp.pre_fc_norm_*`
and `mtp.norm` at random ((1 + w) norms: w near 0). The weights are random: drafts from such a layer are rarely
accepted, which is what a bench of its cost wants and a test of exactness does not mind.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors, write_two_shards


def mtp_block_layer(config: dict) -> int:
    """The layer whose block the MTP layer copies: the last, or the last with an indexer of its own where the
    config's `indexer_types` has "shared" layers (GLM-5: the MTP layer runs its own indexer)."""
    kinds = config.get("indexer_types") or []
    layers = [i for i in range(config["num_hidden_layers"]) if i >= len(kinds) or kinds[i] != "shared"]
    return layers[-1]


def mtp_layer_tensors(tensors: dict[str, torch.Tensor], num_layers: int, hidden: int,
                      generator: torch.Generator | None = None, own_copies: bool = False,
                      block_layer: int | None = None) -> dict[str, torch.Tensor]:
    """Layer `num_layers`'s tensors, from a checkpoint's `tensors` (layer `block_layer`'s block copied; None: the
    last decoder layer's)."""
    block_layer = num_layers - 1 if block_layer is None else block_layer
    last, prefix = f"model.layers.{block_layer}.", f"model.layers.{num_layers}."
    generator = generator or torch.Generator().manual_seed(0)
    mtp = {prefix + n[len(last):]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    for norm in ("enorm", "hnorm", "shared_head.norm"):      # not all ones: a swapped norm would show
        mtp[f"{prefix}{norm}.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=generator)
    mtp[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    if own_copies:
        mtp[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        mtp[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return mtp


def qwen3_next_mtp_tensors(tensors: dict[str, torch.Tensor], layer_types: list[str], hidden: int,
                           generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`mtp.*` from a Qwen3-Next-family checkpoint's `tensors` (the last full-attention layer's block copied)."""
    last = f"model.layers.{max(i for i, kind in enumerate(layer_types) if kind == 'full_attention')}."
    mtp = {"mtp.layers.0." + n[len(last):]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.2 * torch.randn(hidden, generator=generator)
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    return mtp


def deepseek_v4_mtp_tensors(tensors: dict[str, torch.Tensor], block_layer: int, hidden: int,
                            generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`mtp.0.*` from a DeepSeek-V4 checkpoint's `tensors`, in DeepSeek's names: layer `block_layer`'s block copied
    (so its attention kind and routing; its attention output scaled up), `e_proj` / `h_proj` and the norms at random,
    the hyper head the target's perturbed."""
    source = f"model.layers.{block_layer}."
    mtp = {"mtp.0." + n[len(source):]: t.clone() for n, t in tensors.items() if n.startswith(source)}
    mtp["mtp.0.attn.wo_b.weight"] *= 8.0   # attention weighs in the drafts: a wrong window or entry shows in them
    for norm in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{norm}.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=generator)
    for projection in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{projection}.weight"] = torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5
    for part in ("fn", "base", "scale"):
        stored = tensors[f"model.hc_head.hc_{part}"]
        mtp[f"mtp.0.hc_head_{part}"] = stored + 0.1 * torch.randn(stored.shape, generator=generator)
    return mtp


def write_mtp_checkpoint(source: Path, target: Path, own_copies: bool = False, seed: int = 0,
                         v4_block_layer: int = 0) -> Path:
    """`source` with an MTP layer appended (and, after the last layer, `num_nextn_predict_layers=1`), as two
    shards in `target`. DeepSeek-V4: `mtp.0.*`, its block drawn from layer `v4_block_layer`."""
    config = json.loads((source / "config.json").read_text())
    tensors = read_all_tensors(source)
    generator = torch.Generator().manual_seed(seed)
    hybrid = "linear_attention" in (config.get("layer_types") or [])
    if config.get("model_type") == "deepseek_v4":
        tensors.update(deepseek_v4_mtp_tensors(tensors, v4_block_layer, config["hidden_size"], generator))
    elif hybrid:
        tensors.update(qwen3_next_mtp_tensors(tensors, config["layer_types"], config["hidden_size"], generator))
    else:
        tensors.update(mtp_layer_tensors(tensors, config["num_hidden_layers"], config["hidden_size"], generator,
                                         own_copies, mtp_block_layer(config)))
    copy_side_files(source, target)
    write_two_shards(tensors, target)
    if not hybrid:
        config["num_nextn_predict_layers"] = 1
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
