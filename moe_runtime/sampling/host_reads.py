"""Counting host reads: the operations that make the host wait for a value computed on the device.

A decode step that reads a device value on the host cannot be captured as a CUDA graph and stalls the
GPU until the read returns (each read is a device synchronisation). On CUDA `torch.cuda.set_sync_debug_mode`
reports the synchronising calls of the CUDA backend; this counter finds the same reads on any device,
the CPU included, so a test on a machine without a GPU can hold the decode path to zero of them.

What counts as a read (each seen where it happens, by a `TorchFunctionMode` and a `TorchDispatchMode`):
- a tensor's value taken as a Python number or list: `.item()`, `int(t)`, `float(t)`, `bool(t)`,
  `.tolist()`, `.numpy()` (aten `_local_scalar_dense`, `is_nonzero`, `equal`, and the two methods);
- an operation whose output shape depends on the values, which a GPU answers only after reading a
  count back: `nonzero`, `masked_select`, boolean-mask indexing (`x[mask]`, `x[mask] = v`), `unique`,
  `bincount`, `repeat_interleave` without `output_size`;
- a copy from a CUDA tensor to the host.

The step's result, its sampled tokens, must reach the host: that one copy, at the end of the step, runs
under `step_result_transfer()` and is not counted. Code that stands in for one fused device kernel on the CPU (the DeepEP emulation of the tests: DeepEP's
low-latency kernels read their counts on the device) runs under `opaque_device_kernel()`, which hides
it from every active mode: what happens inside such a kernel is the kernel's business, not the step's.
"""
from __future__ import annotations

import collections
import contextlib
import sys
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ATEN = torch.ops.aten
TORCH_DIR = torch.__file__.rsplit("/", 1)[0]

# Aten operations that read a device value on the host, or whose output shape depends on device values.
HOST_READ_OPS = frozenset({
    ATEN._local_scalar_dense.default, ATEN.is_nonzero.default, ATEN.equal.default,
    ATEN.nonzero.default, ATEN.nonzero_static.default, ATEN.masked_select.default, ATEN.bincount.default,
    ATEN._unique2.default, ATEN.unique_dim.default, ATEN.unique_consecutive.default,
})
# Tensor methods and functions that hand device values to Python. Counted where Python calls them: some reach
# no aten operation on the way (`tolist`), and `item` of an inference-mode tensor is not seen by a dispatch mode.
HOST_READ_METHODS = frozenset({"tolist", "numpy", "item", "__int__", "__float__", "__bool__", "__index__",
                               "__complex__", "equal"})
INDEX_OPS = frozenset({ATEN.index.Tensor, ATEN.index_put.default, ATEN.index_put_.default,
                       ATEN._index_put_impl_.default})
COPY_OPS = frozenset({ATEN._to_copy.default, ATEN.copy_.default})


class _FunctionReads(TorchFunctionMode):
    def __init__(self, counter: "HostReadCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in HOST_READ_METHODS:
            return func(*args, **(kwargs or {}))
        self.counter.saw(name)
        self.counter.inside_counted_call += 1       # its aten operation is the same read: not counted again
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.inside_counted_call -= 1


class _DispatchReads(TorchDispatchMode):
    def __init__(self, counter: "HostReadCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter.inside_counted_call and _reads_host(func, args, kwargs):
            self.counter.saw(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


def _reads_host(func, args, kwargs) -> bool:
    if func in HOST_READ_OPS:
        return True
    if func is ATEN.repeat_interleave.Tensor or func is ATEN.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None
    if func in INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if func in COPY_OPS:
        return _device_to_host_copy(func, args, kwargs)
    return False


def _device_to_host_copy(func, args, kwargs) -> bool:
    if func is ATEN.copy_.default:
        destination, source = args[0], args[1]
        return source.device.type != "cpu" and destination.device.type == "cpu"
    target = kwargs.get("device")
    return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"


class HostReadCounter:
    """Counts host reads while active (`with counter:`), by operation name; `total` is their sum.

    `sites` counts them by "operation at file:line", the line being the innermost frame outside torch (where
    the runtime asked for the read). Re-entrant over several windows: the counts accumulate. A debugging aid
    (every operation goes through two Python modes while it counts), switched on by
    `EngineConfig.debug_host_reads`.
    """

    def __init__(self):
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self.inside_counted_call = 0
        self._stack = contextlib.ExitStack()

    def saw(self, operation: str) -> None:
        self.counts[operation] += 1
        self.sites[f"{operation} at {_caller_outside_torch()}"] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "HostReadCounter":
        self._stack.enter_context(_FunctionReads(self))
        self._stack.enter_context(_DispatchReads(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def _caller_outside_torch() -> str:
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR) or
                                 frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


@contextlib.contextmanager
def opaque_device_kernel() -> Iterator[None]:
    """Run the enclosed code as one device kernel would run: unseen by the active torch modes."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


@contextlib.contextmanager
def step_result_transfer() -> Iterator[None]:
    """The one transfer a step must make, unseen by the counter: its sampled tokens (and asked logprobs) to
    the host, where the scheduler and the detokenizer need them (`DeviceDraw.to_host`: one copy)."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


class DecodeHostReads:
    """The engine core's count of host reads in its decode steps (`EngineConfig.debug_host_reads`)."""

    def __init__(self):
        self.counter = HostReadCounter()
        self.steps = 0

    @staticmethod
    def window(counting: "DecodeHostReads | None", is_decode_step: bool) -> contextlib.AbstractContextManager:
        """Count what runs inside when counting is on and the step decodes; else nothing."""
        if counting is None or not is_decode_step:
            return contextlib.nullcontext()
        counting.steps += 1
        return counting.counter

    @staticmethod
    def stats(counting: "DecodeHostReads | None") -> dict:
        """The `WorkerStats` fields."""
        if counting is None:
            return {}
        return {"decode_steps_counted": counting.steps, "decode_host_reads": counting.counter.total,
                "decode_host_read_sites": dict(counting.counter.sites)}
