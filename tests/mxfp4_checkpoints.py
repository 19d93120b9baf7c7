"""Tiny checkpoints in gpt-oss's published MXFP4 layout, beside their exact dequantized twins."""
from __future__ import annotations

from pathlib import Path

from moe_runtime.weights.quantization.mxfp4_checkpoint_writer import write_mxfp4_twins


def write_mxfp4_checkpoint(source: str | Path, root: str | Path) -> tuple[Path, Path]:
    """A gpt-oss checkpoint `source` -> (`root`/twin, `root`/mxfp4): its experts rounded to MXFP4 values once,
    written plain (the twin, which transformers and the runtime load as any checkpoint) and in the published
    MXFP4 layout (`*_blocks` / `*_scales`, quant_method mxfp4), which dequantizes to the twin exactly."""
    twin, mxfp4 = Path(root) / "twin", Path(root) / "mxfp4"
    write_mxfp4_twins(Path(source), twin, mxfp4)
    return twin, mxfp4
