"""A torch.distributed emulation of `deep_ep.Buffer`'s documented V1 interface, for CPU tests.

A test double: it lives with the tests, not in the `dispatch` package; tests hand it to the adapter
as `DispatchConfig(deepep_buffer_cls=EmulatedDeepEPBuffer)`.

It honours the return layouts DeepEP documents for the calls our adapter makes, so the adapter
can be held against the dispatch contract on gloo without GPUs:

- `get_dispatch_layout(topk_idx, num_experts)` -> (num_tokens_per_rank [R] int32, None,
  num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)
- `dispatch(x, num_tokens_per_rank=, num_tokens_per_rdma_rank=, is_token_in_rank=,
  num_tokens_per_expert=, topk_idx=, topk_weights=, expert_alignment=)` -> (recv_x [Rn, H],
  recv_topk_idx [Rn, K] local expert ids or -1, recv_topk_weights [Rn, K] (0 where -1),
  num_recv_tokens_per_expert_list, handle, event); each token reaches a rank once. FP8: `x` may
  be the tuple (x [T, H] float8_e4m3fn, scales [T, H // 128] float32, H divisible by 128); then
  recv_x is the tuple (recv_x [Rn, H] float8_e4m3fn, recv_scales [Rn, H // 128] float32).
- `combine(x [Rn, H], handle, topk_weights=None)` -> (combined_x [T, H] unweighted sum,
  combined_topk_weights or None, event)
- `low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
  use_fp8=True)` -> (recv_x [E_local, max * R, H], recv_count [E_local] int32, handle, event,
  hook); one row per (token, expert) pair. Rows past recv_count are NaN, so a consumer that reads
  them is caught. With use_fp8 (DeepEP's default) the buffer quantizes x per 128-column group
  itself (amax / 448 scales, amax floored at 1e-4, as DeepEP's kernel) and recv_x is the tuple
  (values [E_local, max * R, H] float8_e4m3fn, scales [E_local, max * R, H // 128] float32),
  the scales column-major in their last two dims as DeepEP returns them; H divisible by 128.
- `low_latency_combine(x [E_local, max * R, H], topk_idx, topk_weights, handle)` ->
  (combined_x [T, H] weighted sum, event, hook)

It holds its callers to DeepEP's rules (moe_runtime/dispatch/deepep_preconditions.py), so a configuration the
real kernels would refuse fails here too: bfloat16 rows only (or an FP8 pair), the low-latency hidden
sizes DeepEP compiles, a low-latency call only on a buffer made with `low_latency_mode=True` and only
after `clean_low_latency_buffer` once normal-mode traffic has used it, normal calls only on a buffer with
NVLink bytes. `instances` counts the buffers each process made (one per rank is the rule).

Each call runs under `opaque_device_kernel()`: it stands for one DeepEP kernel, which counts on the
device, so its own host reads (the emulation's, on gloo) are not the step's.

Not emulated: round_scale / UE8M0 scales, LogFMT combine, cached-handle dispatch, internode
RDMA, async events, hooks' overlap. Its handles are its own (opaque to callers, as DeepEP's are).

The module's `Buffer` is the emulation, so `EngineConfig(deepep_module="deepep_emulation")` reaches rank
processes with it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moe_runtime.dispatch.collectives import (ColumnSpec, all_to_all_rows, exchange_counts, pack_rows,
                                              unpack_rows)
from moe_runtime.dispatch.deepep_preconditions import DEEPEP_DTYPE, MODE_LOW_LATENCY, MODE_NORMAL, deepep_refusal
from moe_runtime.dispatch.fp8_activations import FP8_DTYPE, GROUP_SIZE, quantize_token_groups
from moe_runtime.sampling.host_reads import opaque_device_kernel


class EmulatedEvent:
    """Stands in for deep_ep's EventOverlap: everything here is already complete."""

    def current_stream_wait(self) -> None:
        return None


class _SizeHintConfig:
    """Stands in for deep_ep.Config's buffer-size hints (the emulation allocates nothing; the sizes say which
    modes a buffer was made for)."""

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 4096

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0 if num_ranks <= 8 else hidden_bytes * num_ranks * 4096


def _emulated_kernel(method):
    """A DeepEP call: one device kernel, unseen by host-read counting."""
    def call(self, *args, **kwargs):
        with opaque_device_kernel():
            return method(self, *args, **kwargs)
    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class DeepEPRuleBroken(RuntimeError):
    """What DeepEP's host assertions would stop (the emulation says which rule)."""


def _check_rows(x, mode: str) -> None:
    if isinstance(x, tuple):            # an FP8 pair: its values were quantized from bf16
        return
    refusal = deepep_refusal(mode, x.dtype, x.shape[-1])
    if refusal is not None:
        raise DeepEPRuleBroken(f"EmulatedDeepEPBuffer ({mode}): {refusal}")


@dataclasses.dataclass
class _NormalHandle:
    send_token_index: torch.Tensor  # [S]
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


@dataclasses.dataclass
class _LowLatencyHandle:
    send_token_index: torch.Tensor  # [P] token of each sent (token, k) pair
    send_k: torch.Tensor            # [P] its k
    send_splits: list[int]
    recv_splits: list[int]
    recv_expert: torch.Tensor       # [Pr] local expert of each received pair
    recv_position: torch.Tensor     # [Pr] its row in recv_x[expert]
    num_tokens: int


class EmulatedDeepEPBuffer:
    num_sms: int = 20
    instances: int = 0          # buffers made in this process

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 12, **_ignored):
        EmulatedDeepEPBuffer.instances += 1
        self.low_latency_memory_dirty = False
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _SizeHintConfig:
        return _SizeHintConfig()

    @staticmethod
    def get_combine_config(num_ranks: int) -> _SizeHintConfig:
        return _SizeHintConfig()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return 2 * num_max_dispatch_tokens_per_rank * hidden * DEEPEP_DTYPE.itemsize * num_experts

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self.low_latency_memory_dirty = False

    def _normal_call(self) -> None:
        if self.num_nvl_bytes <= 0:
            raise DeepEPRuleBroken("EmulatedDeepEPBuffer: a normal-mode call on a buffer made without NVLink bytes")
        self.low_latency_memory_dirty = True

    def _low_latency_call(self) -> None:
        if not self.low_latency_mode or self.num_rdma_bytes <= 0:
            raise DeepEPRuleBroken("EmulatedDeepEPBuffer: a low-latency call on a buffer made without "
                                   "low_latency_mode=True and RDMA bytes")
        if self.low_latency_memory_dirty:
            raise DeepEPRuleBroken("EmulatedDeepEPBuffer: a low-latency call after normal-mode traffic without "
                                   "clean_low_latency_buffer (DeepEP's kernels expect that memory zeroed)")

    # ---------------------------------------------------------------- normal (throughput) mode
    @_emulated_kernel
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        experts_per_rank = num_experts // self.group_size
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // experts_per_rank, -1)                  # [T, K]
        ranks = torch.arange(self.group_size, device=topk_idx.device)
        is_token_in_rank = (dest.unsqueeze(-1) == ranks).any(dim=1)                 # [T, R]
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts)
        return (num_tokens_per_rank, None, num_tokens_per_expert.to(torch.int32),
                is_token_in_rank, EmulatedEvent())

    @_emulated_kernel
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, config=None,
                 previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        if handle is not None:
            raise NotImplementedError("EmulatedDeepEPBuffer: cached-handle dispatch")
        self._normal_call()
        _check_rows(x, MODE_NORMAL)
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if x_scales is not None:
            _check_fp8_rows(x, x_scales)
        for name, value in (("num_tokens_per_rank", num_tokens_per_rank),
                            ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert),
                            ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if value is None:
                raise ValueError(f"EmulatedDeepEPBuffer.dispatch: {name} is required")
        num_topk = topk_idx.shape[1]
        experts_per_rank = num_tokens_per_expert.numel() // self.group_size
        dest_rank, token = is_token_in_rank.t().nonzero(as_tuple=True)             # rank-major
        begin = (dest_rank * experts_per_rank).unsqueeze(1)                        # [S, 1]
        idx = topk_idx[token]                                                      # [S, K]
        local = torch.where((idx >= begin) & (idx < begin + experts_per_rank), idx - begin, -1)
        weight = torch.where(local >= 0, topk_weights[token].to(torch.float32), 0.0)

        send_counts = num_tokens_per_rank.to(torch.int64)
        send_splits = send_counts.tolist()
        recv_splits = exchange_counts(send_counts, self.group).tolist()
        hidden = [x] if x_scales is None else [x, x_scales]      # values (+ their scales)
        specs = [*(ColumnSpec(c.dtype, c.shape[1]) for c in hidden),
                 ColumnSpec(torch.int64, num_topk), ColumnSpec(torch.float32, num_topk)]
        received = all_to_all_rows(pack_rows(*(c[token] for c in hidden), local, weight),
                                   send_splits, recv_splits, self.group)
        *recv_hidden, recv_topk_idx, recv_topk_weights = unpack_rows(received, specs)
        recv_x = tuple(recv_hidden) if x_scales is not None else recv_hidden[0]

        per_expert = torch.bincount(recv_topk_idx[recv_topk_idx >= 0],
                                    minlength=experts_per_rank)
        aligned = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
        handle = _NormalHandle(token, send_splits, recv_splits, x.shape[0])
        return (recv_x, recv_topk_idx, recv_topk_weights, aligned.tolist(), handle,
                EmulatedEvent())

    @_emulated_kernel
    def combine(self, x, handle: _NormalHandle, topk_weights=None, config=None,
                previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sums (without weights) the rows each rank sends back for a token."""
        self._normal_call()
        _check_rows(x, MODE_NORMAL)
        returned = all_to_all_rows(x, handle.recv_splits, handle.send_splits, self.group)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        combined = torch.zeros(handle.num_tokens, x.shape[1], dtype=acc_dtype, device=x.device)
        combined.index_add_(0, handle.send_token_index, returned.to(acc_dtype))
        combined_weights = None
        if topk_weights is not None:
            back = all_to_all_rows(topk_weights, handle.recv_splits, handle.send_splits,
                                   self.group)
            combined_weights = torch.zeros(handle.num_tokens, topk_weights.shape[1],
                                           dtype=topk_weights.dtype, device=x.device)
            combined_weights.index_add_(0, handle.send_token_index, back)
        return combined.to(x.dtype), combined_weights, EmulatedEvent()

    # ---------------------------------------------------------------- low-latency mode
    @_emulated_kernel
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             **_ignored):
        if round_scale or use_ue8m0:
            raise NotImplementedError("EmulatedDeepEPBuffer: round_scale / UE8M0 FP8 scales")
        self._low_latency_call()
        _check_rows(x, MODE_LOW_LATENCY)
        if use_fp8 and x.shape[1] % GROUP_SIZE:
            raise ValueError(f"EmulatedDeepEPBuffer: FP8 low-latency dispatch needs hidden "
                             f"divisible by {GROUP_SIZE}, got {x.shape[1]}")
        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"EmulatedDeepEPBuffer: {x.shape[0]} tokens exceed "
                             f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}")
        num_ranks = self.group_size
        experts_per_rank = num_experts // num_ranks
        pair_token, pair_k = (topk_idx >= 0).nonzero(as_tuple=True)
        pair_expert = topk_idx[pair_token, pair_k]
        order = torch.sort(pair_expert, stable=True).indices   # rank-major, expert, then token
        pair_token, pair_k, pair_expert = pair_token[order], pair_k[order], pair_expert[order]
        send_counts = torch.bincount(pair_expert // experts_per_rank, minlength=num_ranks)
        send_splits = send_counts.to(torch.int64).tolist()
        recv_splits = exchange_counts(send_counts.to(torch.int64), self.group).tolist()
        if use_fp8:                                  # DeepEP casts in its send kernel
            quantized = quantize_token_groups(x)
            hidden = [quantized.values, quantized.scales]        # [T, H] fp8, [T, H // 128] f32
        else:
            hidden = [x]
        specs = [*(ColumnSpec(c.dtype, c.shape[1]) for c in hidden), ColumnSpec(torch.int64, 1)]
        local = (pair_expert % experts_per_rank).unsqueeze(1)
        received = all_to_all_rows(pack_rows(*(c[pair_token] for c in hidden), local),
                                   send_splits, recv_splits, self.group)
        *recv_hidden, recv_local = unpack_rows(received, specs)
        recv_local = recv_local.view(-1)

        # Pack per local expert: source rank ascending, then token order (received order).
        regroup = torch.sort(recv_local, stable=True).indices
        recv_count = torch.bincount(recv_local, minlength=experts_per_rank)
        starts = torch.cumsum(recv_count, 0) - recv_count
        sorted_expert = recv_local[regroup]
        sorted_position = torch.arange(regroup.numel(), device=x.device) - starts[sorted_expert]
        position = torch.empty_like(recv_local)
        position[regroup] = sorted_position

        capacity = num_max_dispatch_tokens_per_rank * num_ranks
        packed = [torch.full((experts_per_rank, capacity, c.shape[1]), float("nan"),
                             dtype=c.dtype, device=x.device) for c in recv_hidden]
        if use_fp8:
            # DeepEP's scales are column-major in their last two dims (TMA-friendly): the
            # transpose of a contiguous [E_local, H // 128, capacity].
            packed[1] = packed[1].transpose(1, 2).contiguous().transpose(1, 2)
        for out, rows in zip(packed, recv_hidden):
            out[recv_local, position] = rows
        handle = _LowLatencyHandle(pair_token, pair_k, send_splits, recv_splits, recv_local,
                                   position, x.shape[0])
        hook = (lambda: None) if return_recv_hook else None
        recv_x = tuple(packed) if use_fp8 else packed[0]
        return recv_x, recv_count.to(torch.int32), handle, EmulatedEvent(), hook

    @_emulated_kernel
    def low_latency_combine(self, x, topk_idx, topk_weights, handle: _LowLatencyHandle,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out=None, **_ignored):
        """Sends each pair's expert output home and reduces it there with its top-k weight."""
        self._low_latency_call()
        _check_rows(x, MODE_LOW_LATENCY)
        rows = x[handle.recv_expert, handle.recv_position]                          # [Pr, H]
        returned = all_to_all_rows(rows, handle.recv_splits, handle.send_splits, self.group)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        weight = topk_weights[handle.send_token_index, handle.send_k].to(acc_dtype)
        combined = torch.zeros(handle.num_tokens, x.shape[2], dtype=acc_dtype, device=x.device)
        combined.index_add_(0, handle.send_token_index, returned.to(acc_dtype) * weight[:, None])
        combined = combined.to(x.dtype)
        if out is not None:
            out.copy_(combined)
            combined = out
        hook = (lambda: None) if return_recv_hook else None
        return combined, EmulatedEvent(), hook


def _check_fp8_rows(values: torch.Tensor, scales: torch.Tensor) -> None:
    """What DeepEP documents for FP8 `dispatch` input: ([T, H] float8_e4m3fn, [T, H // 128] float32)."""
    if values.dtype != FP8_DTYPE or scales.dtype != torch.float32:
        raise ValueError(f"EmulatedDeepEPBuffer.dispatch: FP8 x must be (float8_e4m3fn, float32), got "
                         f"({values.dtype}, {scales.dtype})")
    hidden = values.shape[1]
    if hidden % GROUP_SIZE or tuple(scales.shape) != (values.shape[0], hidden // GROUP_SIZE):
        raise ValueError(f"EmulatedDeepEPBuffer.dispatch: FP8 scales must be [T, hidden // {GROUP_SIZE}] "
                         f"with hidden divisible by {GROUP_SIZE}; got values {tuple(values.shape)}, "
                         f"scales {tuple(scales.shape)}")


Buffer = EmulatedDeepEPBuffer   # `deepep_module="deepep_emulation"`: this module's Buffer is DeepEP's
