"""Tiny FP8 block-quantized checkpoints in exactly DeepSeek-V3's published layout, and their oracle.

From a tiny fp32 checkpoint: every decoder-layer linear weight is quantized blockwise to
float8_e4m3fn with its `weight_scale_inv`, the config gains `quantization_config`, an MTP layer
(`num_nextn_predict_layers`) is appended, and the tensors are written as two shards with an
index (moe_runtime.weights.quantization.fp8_checkpoint_writer). The oracle checkpoint holds the
dequantized weights in fp32 with no quantization config, so transformers on it computes exactly
what a correct FP8 loader must.
"""
from __future__ import annotations

import json
from pathlib import Path

from moe_runtime.weights.mtp_checkpoint_writer import mtp_block_layer, mtp_layer_tensors
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat
from moe_runtime.weights.quantization.fp8_checkpoint_writer import (
    copy_side_files, fp8_config, quantize_tensors, read_all_tensors, write_two_shards,
)


def write_fp8_checkpoint(source: Path, fp8_dir: Path, oracle_dir: Path, block: tuple[int, int],
                         with_mtp: bool = True, mtp_oracle_dir: Path | None = None) -> tuple[Path, Path]:
    """(FP8 checkpoint, dequantized oracle checkpoint) from the fp32 checkpoint `source`; with `mtp_oracle_dir`,
    also the dequantized checkpoint with its MTP layer there (what the MTP layer must draft from)."""
    fmt = Fp8BlockFormat(*block)
    config = json.loads((source / "config.json").read_text())
    tensors = read_all_tensors(source)
    if with_mtp:
        tensors.update(mtp_layer_tensors(tensors, config["num_hidden_layers"], config["hidden_size"],
                                         block_layer=mtp_block_layer(config)))
    written = quantize_tensors(tensors, fmt)
    copy_side_files(source, fp8_dir)
    write_two_shards(written.quantized, fp8_dir)
    quantized_config = fp8_config(config, fmt)
    if with_mtp:
        quantized_config["num_nextn_predict_layers"] = 1
    (fp8_dir / "config.json").write_text(json.dumps(quantized_config, indent=2))
    copy_side_files(source, oracle_dir)
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    write_two_shards({n: t for n, t in written.dequantized.items() if not n.startswith(mtp_prefix)}, oracle_dir)
    if with_mtp and mtp_oracle_dir is not None:
        copy_side_files(source, mtp_oracle_dir)
        write_two_shards(written.dequantized, mtp_oracle_dir)
        (mtp_oracle_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return fp8_dir, oracle_dir
