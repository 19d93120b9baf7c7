"""Watch a call for host reads and large fills (a TorchDispatchMode): what a capture-safe kernel must not do.

A host read is a `_local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`, a Python `if` on a tensor) or
a copy from a CUDA tensor to the CPU: either stalls the GPU and breaks CUDA-graph capture. A fill is
an op that writes one value over a whole new tensor (zeros, full, fill_, zero_); the test gives the
size from which one counts (a masked layout's [E*M, H] output, say).

Used by the Triton kernel cases (in the interpreter, where kernels run as Python on CPU tensors, the
dispatch mode still sees every torch op the host code issues) and by gpu_check's kernels part.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FILL_OPS = ("zeros", "zero_", "fill_", "full", "new_zeros", "new_full", "zeros_like", "full_like")


@dataclass
class HostReadWatch(TorchDispatchMode):
    """`with HostReadWatch(min_fill_elements=n) as watch: ...` then `watch.host_reads`, `watch.fills`."""

    min_fill_elements: int = 1
    host_reads: list[str] = field(default_factory=list)
    fills: list[str] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.host_reads.append(str(func))
        elif name in ("_to_copy", "copy_") and self._device_to_host(name, args, kwargs, out):
            self.host_reads.append(str(func))
        if name in FILL_OPS and isinstance(out, torch.Tensor) and out.numel() >= self.min_fill_elements:
            self.fills.append(f"{func} {tuple(out.shape)}")
        return out

    @staticmethod
    def _device_to_host(name, args, kwargs, out) -> bool:
        if name == "copy_":
            destination, source = args[0], args[1]
        else:
            destination, source = out, args[0]
        return (isinstance(source, torch.Tensor) and isinstance(destination, torch.Tensor)
                and source.device.type != "cpu" and destination.device.type == "cpu")
