"""Adapter from the dispatch contract to DeepEP's `deep_ep.Buffer` (V1 API).

Two modes, following DeepEP's own split:
- normal (prefill): `get_dispatch_layout` + `dispatch` send each token once per destination rank;
  received rows carry `recv_topk_idx` already translated to local expert ids (-1 = not here) and
  `recv_topk_weights` (0 there). We expand them into the contiguous layout grouped by local
  expert, and on combine fold the expert outputs back into one weighted row per received token,
  because DeepEP's normal `combine` sums rows without weights.
- low-latency (decode): `low_latency_dispatch` returns the masked layout
  `[E_local, max_tokens_per_rank * R, H]` with per-expert counts; `low_latency_combine` applies the
  routing weights itself. The number of tokens per call is bounded by `max_tokens_per_rank`.

FP8 activations (`fp8_activations=True`), with DeepEP's own API:
- normal: we quantize x per token group (moe_runtime/dispatch/fp8_activations.py) and pass `x` as the tuple
  `(x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32)`; `dispatch` then returns `recv_x`
  as the same kind of tuple, which we dequantize to the compute dtype.
- low-latency: `low_latency_dispatch(..., use_fp8=True)` quantizes inside the kernel and returns
  `recv_x` as `(values [E_local, M, H] float8_e4m3fn, scales [E_local, M, H // 128] float32)`,
  the scales column-major in their last two dims; we dequantize to the compute dtype
  (round_scale / UE8M0 scales are not used).
Both need H divisible by 128 (one scale per 128 columns), which `fp8_activations_refusal` says.
Combine stays in the compute dtype (DeepEP combines bf16).

DeepEP places experts by its own rule (expert e on rank e // experts_per_rank as local expert
e % experts_per_rank): the `SlotLayout` given must be that contiguous one (`load_balancer.SlotGeometry`
is).

Both modes of a rank share one buffer (moe_runtime/dispatch/deepep_buffer.py); the dispatcher enters its mode before
each step (`begin_step`), which cleans the low-latency memory after normal-mode use. What DeepEP accepts
(bf16 rows, the low-latency hidden sizes) is checked before a buffer is made (moe_runtime/dispatch/deepep_preconditions.py).

`deep_ep` is imported only when a DeepEP dispatcher is built, so `import dispatch` never needs it. Another
module with DeepEP's `Buffer` API can stand in for it (`DispatchConfig.deepep_module`, `--deepep-module`):
a fork or a drop-in implementation, or, in the tests, a CPU emulation on gloo with DeepEP's documented
return layouts (tests/deepep_emulation.py), which also reaches rank processes that way.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS, LAYOUT_MASKED, DispatchOutput, Dispatcher
from moe_runtime.dispatch.deepep_buffer import SharedDeepEPBuffer
from moe_runtime.dispatch.deepep_ops import LowLatencyCalls, low_latency_combine, low_latency_dispatch
from moe_runtime.dispatch.deepep_preconditions import MODE_LOW_LATENCY, MODE_NORMAL, deepep_refusal
from moe_runtime.dispatch.fp8_activations import GROUP_SIZE, Fp8Activations, dequantize, quantize_token_groups
from moe_runtime.dispatch.grouping import ExpertGrouping, gather_grouped, group_by_local_expert, reduce_grouped
from moe_runtime.dispatch.slots import SlotLayout, check_dispatch_inputs


DEFAULT_DEEPEP_MODULE = "deep_ep"


def import_deep_ep_buffer(module: str = DEFAULT_DEEPEP_MODULE) -> type:
    """`<module>.Buffer` (DeepEP's), with an error that says what to install when it is missing."""
    try:
        return importlib.import_module(module).Buffer
    except (ImportError, AttributeError) as err:
        raise ImportError(f"dispatch backend 'deepep' needs the {module} package's Buffer (DeepEP, "
                          "https://github.com/deepseek-ai/DeepEP); install it or pick "
                          "backend 'all_to_all'") from err


@functools.cache
def deep_ep_importable(module: str = DEFAULT_DEEPEP_MODULE) -> bool:
    """Whether DeepEP imports, asked once per process ('auto' asks it for every dispatcher it resolves, and
    a failed import is not cheap: 0.3 ms each, twice per step before this was cached)."""
    try:
        import_deep_ep_buffer(module)
    except ImportError:
        return False
    return True


@dataclasses.dataclass
class _NormalHandle:
    deepep_handle: object
    grouping: ExpertGrouping  # over the received rows
    dtype: torch.dtype


@dataclasses.dataclass
class _LowLatencyHandle:
    topk_idx: torch.Tensor      # [T, K] int64
    topk_weights: torch.Tensor  # [T, K] float32 (DeepEP's own handle waits in the dispatcher's LowLatencyCalls)


class DeepEPDispatcher(Dispatcher):
    """`buffer`: the rank's DeepEP buffer, shared with its other mode's dispatcher (sized for this mode)."""

    def __init__(self, slots: SlotLayout, buffer: SharedDeepEPBuffer, hidden_size: int, dtype: torch.dtype,
                 mode: str = MODE_NORMAL, max_tokens_per_rank: int | None = None, fp8_activations: bool = False):
        if mode not in (MODE_NORMAL, MODE_LOW_LATENCY):
            raise ValueError(f"DeepEPDispatcher mode {mode!r} is not 'normal' or 'low_latency'")
        if mode == MODE_LOW_LATENCY and max_tokens_per_rank is None:
            raise ValueError("DeepEPDispatcher low_latency mode needs max_tokens_per_rank "
                             "(DispatchConfig.max_tokens_per_rank)")
        refusal = deepep_refusal(mode, dtype, hidden_size)
        if refusal is not None:
            raise ValueError(f"DeepEPDispatcher ({mode} mode) cannot run: {refusal}")
        refusal = self.fp8_activations_refusal(hidden_size) if fp8_activations else None
        if refusal is not None:
            raise ValueError(f"DeepEPDispatcher cannot send FP8 activations: {refusal}")
        if mode not in buffer.modes:
            raise ValueError(f"DeepEPDispatcher {mode} mode: the shared buffer was sized for {sorted(buffer.modes)}")
        self.slots = slots
        self.hidden_size = hidden_size
        self.mode = mode
        self._max_tokens = max_tokens_per_rank
        self.fp8_activations = fp8_activations
        self.shared = buffer
        self.buffer = buffer.buffer
        self.low_latency = None if mode == MODE_NORMAL else LowLatencyCalls(
            self._low_latency_dispatch_call, self._low_latency_combine_call,
            (slots.slots_per_rank, max_tokens_per_rank * slots.num_ranks, hidden_size), hidden_size)

    def begin_step(self) -> None:
        self.shared.enter(self.mode)
        if self.low_latency is not None:
            self.low_latency.clear()

    def layout(self) -> str:
        return LAYOUT_CONTIGUOUS if self.mode == MODE_NORMAL else LAYOUT_MASKED

    def max_tokens_per_rank(self) -> int | None:
        return self._max_tokens if self.mode == MODE_LOW_LATENCY else None

    def sends_fp8_activations(self) -> bool:
        return self.fp8_activations

    @classmethod
    def fp8_activations_refusal(cls, hidden_size: int) -> str | None:
        if hidden_size % GROUP_SIZE:
            return (f"DeepEP's FP8 dispatch carries one float32 scale per {GROUP_SIZE} hidden "
                    f"columns (scales [T, hidden // {GROUP_SIZE}]) and needs hidden_size divisible "
                    f"by {GROUP_SIZE}, got {hidden_size}")
        return None

    def dispatch(self, x, slot_ids, weights) -> DispatchOutput:
        check_dispatch_inputs(x, slot_ids, weights, self.slots.num_slots, self.hidden_size,
                              check_values=self.mode == MODE_NORMAL)   # low latency: no host read
        # the shared buffer entered this mode in begin_step; no traffic is counted (`last_stats` None): that would
        # read the device
        weights = weights.to(torch.float32)
        if self.mode == MODE_NORMAL:
            return self._dispatch_normal(x, slot_ids, weights)
        return self._dispatch_low_latency(x, slot_ids, weights)

    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        if isinstance(handle, _NormalHandle):
            partial = reduce_grouped(expert_out, handle.grouping, handle.dtype)   # [Rn, H]
            combined_x, _, _ = self.buffer.combine(partial, handle.deepep_handle)
            return combined_x
        return low_latency_combine(expert_out, handle.topk_idx, handle.topk_weights, self.low_latency.id)

    def _dispatch_normal(self, x, slot_ids, weights) -> DispatchOutput:
        num_slots = self.slots.num_slots
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
         is_token_in_rank, _) = self.buffer.get_dispatch_layout(slot_ids, num_slots)
        if self.fp8_activations:
            quantized = quantize_token_groups(x)
            sent = (quantized.values, quantized.scales)          # ([T, H] fp8, [T, H // 128] f32)
        else:
            sent = x
        recv, recv_topk_idx, recv_topk_weights, _, deepep_handle, _ = self.buffer.dispatch(
            sent, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=slot_ids, topk_weights=weights)
        recv_x = dequantize(Fp8Activations(*recv), x.dtype) if self.fp8_activations else recv  # [Rn, H]
        # recv_topk_idx [Rn, K]: local expert ids on this rank, -1 elsewhere.
        grouping = group_by_local_expert(recv_topk_idx.to(torch.int64), recv_topk_weights,
                                         self.slots.slots_per_rank)
        return DispatchOutput(recv_x=gather_grouped(recv_x, grouping),
                              tokens_per_local_expert=grouping.tokens_per_local_expert,
                              handle=_NormalHandle(deepep_handle, grouping, x.dtype))

    def _dispatch_low_latency(self, x, slot_ids, weights) -> DispatchOutput:
        if x.shape[0] > self._max_tokens:
            raise ValueError(f"dispatch: x has {x.shape[0]} tokens, more than this low-latency "
                             f"dispatcher's max_tokens_per_rank={self._max_tokens}")
        recv_x, recv_count = low_latency_dispatch(x, slot_ids, self.low_latency.id)   # [E_local, M, H], [E_local]
        return DispatchOutput(recv_x=recv_x, tokens_per_local_expert=recv_count,
                              handle=_LowLatencyHandle(slot_ids, weights))

    def _low_latency_dispatch_call(self, x, slot_ids):
        """DeepEP's call inside the dispatch operator (moe_runtime/dispatch/deepep_ops.py)."""
        recv, recv_count, deepep_handle, _, _ = self.buffer.low_latency_dispatch(
            x, slot_ids, self._max_tokens, self.slots.num_slots, use_fp8=self.fp8_activations)
        # FP8: (values [E_local, M, H], scales [E_local, M, H // 128]); rows past recv_count are
        # garbage either way, and dequantizing them is harmless.
        recv_x = dequantize(Fp8Activations(*recv), x.dtype) if self.fp8_activations else recv
        return recv_x, recv_count, deepep_handle

    def _low_latency_combine_call(self, expert_out, topk_idx, topk_weights, deepep_handle):
        """DeepEP's call inside the combine operator."""
        combined_x, _, _ = self.buffer.low_latency_combine(expert_out, topk_idx, topk_weights, deepep_handle)
        return combined_x
