"""Tiny DeepSeek-V4 checkpoints in the release's layout (FP8 block linears, FP4 routed experts), beside their exact
dequantized twins.

From a tiny random transformers V4 checkpoint (tests/tiny_checkpoints.py), `write_v4_release` writes

- the release (DeepSeek-V4-Flash's names and dtypes): `embed.weight`, `layers.L.attn.wq_a.weight` float8_e4m3fn
  with `layers.L.attn.wq_a.scale` float8_e8m0fnu (one power of two per block), routed experts
  `layers.L.ffn.experts.E.w1.weight` int8 [N, K/2] (two e2m1 codes a byte, low nibble first) with `.scale`
  float8_e8m0fnu [N, K/32], the compressors' and indexer's kv / gate / weights projections, the routers, embeddings,
  head and norms in bfloat16 without scales, hyper-connections, sinks, position biases and the correction bias in
  float32; config.json with quantization_config (quant_method fp8, fmt e4m3, scale_fmt ue8m0) and V4's top-level
  `expert_dtype: fp4`;
- the twin: transformers' layout in float32, each tensor the release's exactly dequantized, which transformers and
  the runtime load as any checkpoint (the oracle runs on it).

The blocks are BLOCK (16 x 16) instead of the release's 128 x 128, as the tiny model's HCA rate is shrunk: the tiny
linears are 24 to 256 wide, so 128-blocks would give each a single scale and a reader's block indexing would go
untested.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_runtime.kernels.mxfp4_weights import dequantize_mxfp4, quantize_mxfp4

BLOCK = (16, 16)
FP8_MAX = 448.0
FP4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP8_LINEAR = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$")
KEPT_FP32 = re.compile(r"hc_|attn_sink|\.ape$|\.gate\.bias$|\.attn\.(.*\.)?(q_norm|norm)\.weight$")   # transformers' strict fp32


def release_name(saved: str) -> str:
    """transformers' saved name -> the name DeepSeek publishes."""
    name = saved.removeprefix("model.").replace("embed_tokens.", "embed.")
    return name.replace("hc_head.hc_", "hc_head_")


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 values [N, K], e8m0 block scales, the exact dequantized float32 [N, K]): each block's scale the smallest
    power of two bringing its largest magnitude within FP8_MAX."""
    rows, cols = weight.shape
    bn, bk = block
    blocks = weight.float().reshape(rows // bn, bn, cols // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=2.0 ** -100)                       # [N/bn, K/bk]
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / FP8_MAX)))
    values = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (values.float() * scale[:, None, :, None]).reshape(rows, cols)
    return values.reshape(rows, cols), scale.to(torch.float8_e8m0fnu), dequantized


def fp4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 [N, K/2] packed e2m1, e8m0 scales [N, K/32], the exact dequantized float32 [N, K])."""
    values, scales = quantize_mxfp4(weight)
    return values.view(torch.int8), scales.view(torch.float8_e8m0fnu), dequantize_mxfp4(values, scales, weight.shape[1])


def write_v4_release(source: str | Path, root: str | Path, block: tuple[int, int] = BLOCK) -> tuple[Path, Path]:
    """A transformers V4 checkpoint `source` -> (`root`/twin, `root`/release)."""
    source, root = Path(source), Path(root)
    twin, release = root / "twin", root / "release"
    for target in (twin, release):
        target.mkdir(parents=True)
        for file in source.iterdir():
            if file.is_file() and file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
                shutil.copyfile(file, target / file.name)
    twin_tensors, release_tensors = {}, {}
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for saved in handle.keys():
                tensor, name = handle.get_tensor(saved), release_name(saved)
                if FP4_EXPERT.search(saved):
                    packed, scale, exact = fp4_rows(tensor)
                    release_tensors[name], release_tensors[name.removesuffix("weight") + "scale"] = packed, scale
                elif FP8_LINEAR.search(saved):
                    values, scale, exact = fp8_blocks(tensor, block)
                    release_tensors[name], release_tensors[name.removesuffix("weight") + "scale"] = values, scale
                elif tensor.is_floating_point() and not KEPT_FP32.search(saved):
                    release_tensors[name] = tensor.to(torch.bfloat16)
                    exact = release_tensors[name].float()
                else:
                    release_tensors[name] = exact = tensor
                twin_tensors[saved] = exact.contiguous()
    save_file(twin_tensors, str(twin / "model.safetensors"))
    save_file({name: t.contiguous() for name, t in release_tensors.items()}, str(release / "model.safetensors"))
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"] = dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                         scale_fmt="ue8m0", weight_block_size=list(block))
    config["expert_dtype"] = "fp4"
    (release / "config.json").write_text(json.dumps(config, indent=2))
    return twin, release
