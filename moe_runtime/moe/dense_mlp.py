"""A dense SiLU-gated MLP is `ExpertWeights` with one local expert that every token uses with weight 1.

In the compute dtype it runs as the expert SwiGLU's two matmuls on all T rows (kernels.expert_mlp.swiglu: no
router, no dispatch, and no segment sizes read off the device); kept quantized it runs through its format's
expert kernel (contiguous layout, one segment of all T rows), as a routed expert does. Under tensor parallelism the one
expert is split along its intermediate dim, exactly as an expert is: rank r holds gate/up rows and
down columns [r * I/tp, (r + 1) * I/tp), and the ranks' partial outputs are summed with one
all-reduce. Kept in FP8, the down projection's column shard must start on a scale block; a shard
that does not keeps this MLP in the compute dtype (int8 has one scale per whole row: the column shard
is cut from the quantized weight and keeps the full rows' scales, so any shard fits).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS
from moe_runtime.kernels import KernelSet
from moe_runtime.kernels.batch_invariant import BATCH_INVARIANT
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.kernels.expert_mlp import swiglu
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.moe.expert_kernel import expert_kernel_for
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization


class DenseMLP(ExpertWeights):
    def __init__(self, hidden_size: int, intermediate_size: int, kernels: KernelSet, dtype=torch.float32,
                 device=None, tp_size: int = 1, tp_rank: int = 0, tp_group=None,
                 quant: WeightQuantization | None = None, activation: ExpertActivation = ExpertActivation()):
        shard = intermediate_size // tp_size
        start = tp_rank * shard
        if quant is not None and not quant.fits_columns(start, start + shard, intermediate_size):
            quant = None
        # w13 [1, 2I/tp, H], w2 [1, H, I/tp]
        super().__init__([0], hidden_size, shard, dtype=dtype, device=device, quant=quant, activation=activation)
        self.shard_start = start
        self.tp_size, self.tp_group = tp_size, tp_group
        self._kernel = expert_kernel_for(LAYOUT_CONTIGUOUS, kernels)
        self._plain_matmuls = kernels.name != BATCH_INVARIANT   # --deterministic: the family's fixed-order kernel

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        """`<prefix>gate_proj.weight` etc. (no expert index), this rank's shard of each."""
        shard = self.intermediate_size
        start, stop = self.shard_start, self.shard_start + shard
        for rows, name in ((slice(0, shard), "gate_proj"), (slice(shard, 2 * shard), "up_proj")):
            full = f"{prefix}{name}.weight"
            self._fill(0, rows, self._read_shard(reader, full, 0, start, stop), full, reader)
        full = f"{prefix}down_proj.weight"
        self._fill(0, None, self._read_shard(reader, full, 1, start, stop), full, reader)
        return {"w13", "w2"} | ({"w13_scale", "w2_scale"} if self.quant else set())

    def _read_shard(self, reader: CheckpointReader, full: str, dim: int, start: int, stop: int):
        """This rank's rows (dim 0) or columns (dim 1) of a tensor, quantized when kept quantized."""
        if self.tp_size == 1:
            return self._read(reader, full)
        if self.quant is None:
            return reader.read_slice(full, dim, start, stop)
        return self.quant.read_slice(reader, full, dim, start, stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if self.quant is None and self._plain_matmuls:
            # the one expert on all rows as two plain matmuls: the grouped kernel would read its segment sizes off
            # the device (a stall on a GPU, a break in a captured step) and has nothing to group
            out = swiglu(x, self.w13[0], self.w2[0], activation=self.activation)   # [T, H]
        else:
            # [1]: on the input's device, where the expert kernel runs (a Triton kernel cannot read a CPU tensor)
            counts = torch.full((1,), x.shape[0], dtype=torch.long, device=x.device)
            out = self._kernel(x, counts, self)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out
