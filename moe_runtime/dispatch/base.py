"""The dispatch/combine contract every backend implements.

The caller's side of one MoE layer:

    out = dispatcher.dispatch(x, slot_ids, weights)          # tokens -> ranks owning their experts
    y_local = experts(out.recv_x, out.tokens_per_local_expert)  # UNWEIGHTED expert outputs
    y = dispatcher.combine(y_local, out.handle)               # weighted sum back on the owner

Physical expert slots: where each one lives (rank, local expert index) is the `SlotLayout` the
dispatcher was built with (see moe_runtime/dispatch/slots.py); every rank holds `slots_per_rank` of them. Slot
ids < 0 mean "masked, no expert" and contribute 0.

Every rank must call `dispatch` and `combine` in every step, also with T = 0 tokens: the
backends' collectives are joined by all ranks unconditionally.

The two-phase form, for callers that overlap communication with compute (two-batch overlap):

    pending = dispatcher.dispatch_start(x, slot_ids, weights)  # transfer on its way
    ...                                                        # e.g. the other micro-batch's attention
    out = pending.wait()
    pending = dispatcher.combine_start(experts(...), out.handle)
    ...
    y = pending.wait()

Every rank must *start* its dispatches and combines in the same order (that is the order in which
the backends issue their collectives); waits may come in any order. `supports_async()` says whether
a start can return before its transfer is done; a backend that cannot runs the whole transfer in
the start and returns it `Ready`, so the caller's schedule is the same either way.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from moe_runtime.dispatch.pending import Pending, Ready

LAYOUT_CONTIGUOUS = "contiguous"  # recv_x [N, H], rows grouped by local expert
LAYOUT_MASKED = "masked"          # recv_x [E_local, M, H], first tokens_per_local_expert[e] valid


@dataclasses.dataclass
class DispatchOutput:
    recv_x: torch.Tensor                   # contiguous: [N, H]; masked: [E_local, M, H]
    tokens_per_local_expert: torch.Tensor  # [E_local] int64
    handle: object                         # opaque, passed back to combine


@dataclasses.dataclass
class DispatchStats:
    """What one dispatch + combine moved, seen from this rank (bytes include rows sent to self).

    Bytes are those of the messages: with FP8 activations a dispatched row carries FP8 values and
    their scales (moe_runtime/dispatch/activation_wire.py), while combine rows stay in the compute dtype.
    `bytes_saved_by_dedup` compares the payload against sending one row per routed (token, k)
    pair in both directions, which is what a dispatcher without send-once dedup would move.
    """

    pairs_routed: int = 0         # valid (token, k) pairs of this rank's tokens
    rows_sent: int = 0            # hidden-state rows this rank sent in dispatch
    rows_sent_remote: int = 0     # ... of which to other ranks
    dispatch_bytes: int = 0       # payload + routing metadata + counts sent in dispatch
    combine_bytes: int = 0        # partial sums sent back in combine
    remote_bytes: int = 0         # dispatch + combine bytes to other ranks
    bytes_saved_by_dedup: int = 0

    @property
    def bytes_sent(self) -> int:
        return self.dispatch_bytes + self.combine_bytes


class Dispatcher(abc.ABC):
    """Moves tokens to the ranks that own their experts and brings weighted results back."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, slot_ids: torch.Tensor,
                 weights: torch.Tensor) -> DispatchOutput:
        """x [T, H] this rank's tokens (T may be 0), slot_ids [T, K] int64, weights [T, K]."""

    @abc.abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: object) -> torch.Tensor:
        """expert_out: same layout as recv_x, unweighted. Returns y [T, H]:
        y[t] = sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t])."""

    def dispatch_start(self, x: torch.Tensor, slot_ids: torch.Tensor,
                       weights: torch.Tensor) -> Pending[DispatchOutput]:
        """`dispatch`, in two phases: start it, `.wait()` for its output. Backends that overlap
        (`supports_async()`) override this and make `dispatch` the started form waited on at once;
        the default finishes the whole dispatch here."""
        return Ready(self.dispatch(x, slot_ids, weights))

    def combine_start(self, expert_out: torch.Tensor, handle: object) -> Pending[torch.Tensor]:
        """`combine`, in two phases (as `dispatch_start`)."""
        return Ready(self.combine(expert_out, handle))

    _stats: DispatchStats | None = None  # set by each dispatch (+ combine) of backends that count traffic

    def layout(self) -> str:
        """LAYOUT_CONTIGUOUS or LAYOUT_MASKED: the shape of recv_x and of combine's input."""
        return LAYOUT_CONTIGUOUS

    def max_tokens_per_rank(self) -> int | None:
        """Upper bound on T per dispatch call, or None when unbounded."""
        return None

    def begin_step(self) -> None:
        """Called before every step this dispatcher serves, outside any captured graph: a backend that shares
        state with another phase's dispatcher (DeepEP's one buffer for both modes) makes it ready here."""
        return None

    def supports_async(self) -> bool:
        """Whether `dispatch_start` / `combine_start` return while their transfer is still in flight, so
        that the caller's compute overlaps it. False: they return a `Ready` result (the same calls
        work, nothing overlaps)."""
        return False

    def sends_fp8_activations(self) -> bool:
        """Whether dispatch puts FP8 values with per-token-group scales on the wire instead of the
        compute dtype (DispatchConfig.fp8_activations). recv_x is in the compute dtype either way,
        dequantized on arrival, so the expert kernel's contract does not change; only its
        precision does (moe_runtime/dispatch/fp8_activations.py). Combine always moves the compute dtype."""
        return False

    @classmethod
    def fp8_activations_refusal(cls, hidden_size: int) -> str | None:
        """Why this backend cannot send FP8 activations for rows of `hidden_size`, or None when it
        can (or has no wire at all and ignores the option). A class method: DispatchConfig asks it
        before any dispatcher is built. A backend that does not override it is refused."""
        return f"{cls.__name__} has no FP8 wire format"

    @property
    def last_stats(self) -> DispatchStats | None:
        """Traffic of the most recent dispatch (+ combine), for backends that count it."""
        return self._stats


class OverlappingDispatcher(Dispatcher):
    """A backend built on torch.distributed collectives (all_to_all, allgather): its payload collective
    runs with async_op, so `dispatch_start` / `combine_start` are the primitives and `dispatch` /
    `combine` their results waited on at once; its rows carry FP8 activations of any hidden size (a
    partial last group gets its own scale) when `fp8_activations` is set."""

    fp8_activations: bool = False

    @abc.abstractmethod
    def dispatch_start(self, x: torch.Tensor, slot_ids: torch.Tensor,
                       weights: torch.Tensor) -> Pending[DispatchOutput]: ...

    @abc.abstractmethod
    def combine_start(self, expert_out: torch.Tensor, handle: object) -> Pending[torch.Tensor]: ...

    def dispatch(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> DispatchOutput:
        return self.dispatch_start(x, slot_ids, weights).wait()

    def combine(self, expert_out: torch.Tensor, handle: object) -> torch.Tensor:
        return self.combine_start(expert_out, handle).wait()

    def supports_async(self) -> bool:
        return True

    def sends_fp8_activations(self) -> bool:
        return self.fp8_activations

    @classmethod
    def fp8_activations_refusal(cls, hidden_size: int) -> str | None:
        return None
