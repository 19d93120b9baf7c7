"""A dense SiLU-gated MLP is `ExpertWeights` with one local expert that every token uses with weight 1.

It runs through the same expert kernel as routed experts (contiguous layout, one segment of all T
rows), so there is one MLP code path; no router, no dispatch. Under tensor parallelism the one
expert is split along its intermediate dim, exactly as an expert is: rank r holds gate/up rows and
down columns [r * I/tp, (r + 1) * I/tp), and the ranks' partial outputs are summed with one
all-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kernels import KernelSet
from moe_runtime.checkpoint import CheckpointReader, read_slice
from moe_runtime.moe.expert_kernel import ContiguousExpertKernel
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.weight_loading import copy_checked


class DenseMLP(ExpertWeights):
    def __init__(self, hidden_size: int, intermediate_size: int, kernels: KernelSet, dtype=torch.float32,
                 device=None, tp_size: int = 1, tp_rank: int = 0, tp_group=None):
        shard = intermediate_size // tp_size
        super().__init__([0], hidden_size, shard, dtype=dtype, device=device)  # w13 [1, 2I/tp, H], w2 [1, H, I/tp]
        self.shard_start = tp_rank * shard
        self.tp_size, self.tp_group = tp_size, tp_group
        self._kernel = ContiguousExpertKernel(kernels.expert_mlp)

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        """`<prefix>gate_proj.weight` etc. (no expert index), this rank's shard of each."""
        shard = self.intermediate_size
        start, stop = self.shard_start, self.shard_start + shard
        for rows, name in ((slice(0, shard), "gate_proj"), (slice(shard, 2 * shard), "up_proj")):
            full = f"{prefix}{name}.weight"
            tensor = reader.read(full) if self.tp_size == 1 else read_slice(reader, full, 0, start, stop)
            copy_checked(self.w13[0, rows], tensor, full, reader.directory)
        full = f"{prefix}down_proj.weight"
        tensor = reader.read(full) if self.tp_size == 1 else read_slice(reader, full, 1, start, stop)
        copy_checked(self.w2[0], tensor, full, reader.directory)
        return {"w13", "w2"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        # [1]: on the input's device, where the expert kernel runs (a Triton kernel cannot read a CPU tensor)
        counts = torch.full((1,), x.shape[0], dtype=torch.long, device=x.device)
        out = self._kernel(x, counts, self)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out
