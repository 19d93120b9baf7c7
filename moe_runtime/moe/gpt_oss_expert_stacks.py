"""Reading gpt-oss's expert stacks into `ExpertWeights` (w13 rows: gate then up; w2 [H, I]).

transformers' GptOssExperts holds, per MoE block (`<prefix>` = `model.layers.L.mlp.experts.`):
- `gate_up_proj` [E, H, 2I] with gate and up INTERLEAVED along the last dim (gate = columns 0, 2, 4,
  ..., up = 1, 3, 5, ...: `_apply_gate` takes `gate_up[..., ::2]` and `[..., 1::2]`), used as
  x @ gate_up_proj[e] + gate_up_proj_bias[e];
- `gate_up_proj_bias` [E, 2I] (interleaved the same way), `down_proj` [E, I, H], `down_proj_bias` [E, H].

So w13[e] = gate_up_proj[e].T with its even rows first, then its odd rows; w2[e] = down_proj[e].T. An
MXFP4 checkpoint stores `gate_up_proj_blocks` [E, 2I, H/32, 16] (output-major, the same interleaved
rows) and `down_proj_blocks` [E, H, I/32, 16]: kept as MXFP4 (`--quantization mxfp4`), the rows are
de-interleaved as bytes, exactly; otherwise the reader dequantizes them to the [E, H, 2I] layout above.
Only this rank's experts are read (dim 0 of every stack).
"""
from __future__ import annotations

from typing import Protocol

import torch

from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import copy_checked
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows

class ExpertSlots(Protocol):
    """What this loader writes into: `ExpertWeights` (which calls it; a Protocol keeps the two modules apart)."""

    quant: object
    b13: torch.Tensor | None
    b2: torch.Tensor | None

    def fill(self, local: int, rows, values, name: str, reader: CheckpointReader) -> None: ...


def gate_then_up(rows: torch.Tensor) -> torch.Tensor:
    """[2I, ...] interleaved (gate, up, gate, up, ...) -> [2I, ...] gate rows then up rows."""
    return torch.cat([rows[0::2], rows[1::2]])


def load_gpt_oss_expert(experts: ExpertSlots, reader: CheckpointReader, prefix: str, local: int,
                        expert: int) -> None:
    """Fill slot `local` of `experts` with logical expert `expert` of the stacks under `prefix`."""
    gate_up, down = f"{prefix}gate_up_proj", f"{prefix}down_proj"
    keep_mxfp4 = experts.quant is not None and experts.quant.name == "mxfp4"
    if keep_mxfp4 and reader.is_mxfp4(gate_up) and reader.is_mxfp4(down):
        packed = reader.read_mxfp4_rows(gate_up, expert, expert + 1)          # [1, 2I, G*16], [1, 2I, G]
        experts.fill(local, slice(None), QuantizedRows(gate_then_up(packed.values[0]), gate_then_up(packed.scales[0])),
                     gate_up, reader)
        packed = reader.read_mxfp4_rows(down, expert, expert + 1)             # [1, H, G'*16], [1, H, G']
        experts.fill(local, None, QuantizedRows(packed.values[0], packed.scales[0]), down, reader)
    else:
        stack = reader.read_rows(gate_up, expert, expert + 1)[0]              # [H, 2I]
        experts.fill(local, slice(None), gate_then_up(stack.transpose(0, 1)), gate_up, reader)
        stack = reader.read_rows(down, expert, expert + 1)[0]                 # [I, H]
        experts.fill(local, None, stack.transpose(0, 1), down, reader)
    if experts.b13 is not None:
        name = f"{gate_up}_bias"
        copy_checked(experts.b13[local], gate_then_up(reader.read_rows(name, expert, expert + 1)[0]), name,
                     reader.directory)
        name = f"{down}_bias"
        copy_checked(experts.b2[local], reader.read_rows(name, expert, expert + 1)[0], name, reader.directory)
