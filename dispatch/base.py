"""The dispatch/combine contract every backend implements.

The caller's side of one MoE layer:

    out = dispatcher.dispatch(x, slot_ids, weights)          # tokens -> ranks owning their experts
    y_local = experts(out.recv_x, out.tokens_per_local_expert)  # UNWEIGHTED expert outputs
    y = dispatcher.combine(y_local, out.handle)               # weighted sum back on the owner

Physical expert slots: where each one lives (rank, local expert index) is the `SlotLayout` the
dispatcher was built with (see dispatch/slots.py); every rank holds `slots_per_rank` of them. Slot
ids < 0 mean "masked, no expert" and contribute 0.

Every rank must call `dispatch` and `combine` in every step, also with T = 0 tokens: the
backends' collectives are joined by all ranks unconditionally.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

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

    _stats: DispatchStats | None = None  # set by each dispatch (+ combine) of backends that count traffic

    def layout(self) -> str:
        """LAYOUT_CONTIGUOUS or LAYOUT_MASKED: the shape of recv_x and of combine's input."""
        return LAYOUT_CONTIGUOUS

    def max_tokens_per_rank(self) -> int | None:
        """Upper bound on T per dispatch call, or None when unbounded."""
        return None

    def supports_async(self) -> bool:
        """Whether dispatch/combine can overlap with compute (none of the built-in ones do yet)."""
        return False

    @property
    def last_stats(self) -> DispatchStats | None:
        """Traffic of the most recent dispatch (+ combine), for backends that count it."""
        return self._stats
