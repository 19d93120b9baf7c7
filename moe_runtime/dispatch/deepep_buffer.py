"""One DeepEP buffer per rank for both of DeepEP's modes.

A rank dispatches prefill steps in DeepEP's normal mode and decode steps in its low-latency mode. Each
`deep_ep.Buffer` holds NVLink and RDMA memory registered with every peer (and, above 8 ranks, an NVSHMEM
initialisation of its own), so one buffer per mode would double both. One buffer sized for the larger of
the two modes' needs serves both (what DeepEP allows with `low_latency_mode=True` and both sizes given):

- its NVLink bytes are the normal mode's (the low-latency mode needs none), its RDMA bytes the larger of
  the two modes' hints, its queue pairs the larger of the two (low latency wants one per local expert);
- the low-latency kernels expect their part of the RDMA memory zeroed, and normal-mode traffic leaves it
  dirty: DeepEP's rule is to call `clean_low_latency_buffer` after normal use, before the next low-latency
  kernel. `enter(mode)` does that once per switch, at a step boundary, outside any captured graph.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.dispatch.deepep_preconditions import MODE_LOW_LATENCY, MODE_NORMAL


@dataclass(frozen=True)
class DeepEPBufferShape:
    """What sizes a rank's DeepEP buffer."""

    group: object                      # the EP process group
    num_ranks: int
    num_slots: int                     # physical expert slots over the group (DeepEP's num_experts)
    slots_per_rank: int
    hidden_size: int
    hidden_bytes: int                  # one row in the compute dtype
    max_tokens_per_rank: int | None    # low-latency bound; None: the low-latency mode is not used


class SharedDeepEPBuffer:
    def __init__(self, buffer_cls: type, shape: DeepEPBufferShape, modes: frozenset[str]):
        if not modes or not modes <= {MODE_NORMAL, MODE_LOW_LATENCY}:
            raise ValueError(f"SharedDeepEPBuffer modes {sorted(modes)} are not a subset of normal / low_latency")
        if MODE_LOW_LATENCY in modes and shape.max_tokens_per_rank is None:
            raise ValueError("SharedDeepEPBuffer: the low-latency mode needs max_tokens_per_rank")
        self.shape = shape
        self.modes = modes
        num_nvl_bytes = num_rdma_bytes = 0
        num_qps_per_rank = 1
        if MODE_NORMAL in modes:
            for config in (buffer_cls.get_dispatch_config(shape.num_ranks),
                           buffer_cls.get_combine_config(shape.num_ranks)):
                num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(shape.hidden_bytes, shape.num_ranks))
                num_rdma_bytes = max(num_rdma_bytes,
                                     config.get_rdma_buffer_size_hint(shape.hidden_bytes, shape.num_ranks))
            num_qps_per_rank = max(num_qps_per_rank, buffer_cls.num_sms // 2)   # normal internode: one per SM pair
        if MODE_LOW_LATENCY in modes:
            num_rdma_bytes = max(num_rdma_bytes, buffer_cls.get_low_latency_rdma_size_hint(
                shape.max_tokens_per_rank, shape.hidden_size, shape.num_ranks, shape.num_slots))
            num_qps_per_rank = max(num_qps_per_rank, shape.slots_per_rank)
        self.buffer = buffer_cls(shape.group, num_nvl_bytes, num_rdma_bytes,
                                 low_latency_mode=MODE_LOW_LATENCY in modes, num_qps_per_rank=num_qps_per_rank)
        self._low_latency_memory_dirty = False

    def enter(self, mode: str) -> None:
        """Before a step (or a call) in `mode`: clean the low-latency memory once after normal-mode use."""
        if mode not in self.modes:
            raise ValueError(f"this DeepEP buffer was sized for {sorted(self.modes)}, not for {mode!r}")
        if mode == MODE_NORMAL:
            self._low_latency_memory_dirty = True
        elif self._low_latency_memory_dirty:
            shape = self.shape
            self.buffer.clean_low_latency_buffer(shape.max_tokens_per_rank, shape.hidden_size, shape.num_slots)
            self._low_latency_memory_dirty = False
