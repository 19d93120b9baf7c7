"""Staged forward passes: where a micro-batch can step aside while its transfer is in flight.

Only two-batch overlap runs them: one batch, eager or captured, runs the layers' plain `forward`
(MoE: `MoEExecutor.run`, a blocking dispatch -> experts -> combine). A layer's forward written as a
generator (`Staged[T]`) runs its compute and, right after it starts a dispatch or a combine, yields
a `YieldPoint`; the value it finally returns is its output. Two ways to drive one:

- `run_to_end(staged)`: one staged computation with nothing in between (how tests drive one).
- `interleave(first, second)`: two-batch overlap. `first` runs to its next yield point, then
  `second` to its next, and so on, strictly alternating. Each yield point is a transfer in flight,
  so one micro-batch's dispatch or combine travels while the other computes:

      first:   attn  D>|          |experts C>|          |(wait C) attn  D>| ...
      second:        |attn  D>    |          |experts C>|                 | ...
                     (D> / C>: a dispatch / combine started, waited on at the micro-batch's next turn)

Why generators and not threads: the schedule is explicit and deterministic, so every rank of an
EP group starts its collectives in the same order (what the dispatch contract requires), there is
no thread-local state (inference mode, grad mode) to carry over, and an exception simply propagates.
Why strict alternation with `first` leading: a later sequence of a step may reuse KV blocks an
earlier one writes in the same step (prefix caching); the earlier sequences are in `first`, and
`first` always runs a layer's attention before `second` runs that layer's.
"""
from __future__ import annotations

import enum
from typing import Generator, Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


class YieldPoint(enum.Enum):
    """What a staged forward has just started and left in flight."""

    DISPATCH = "dispatch"
    COMBINE = "combine"


Staged = Generator[YieldPoint, None, T]


@runtime_checkable
class StagedModule(Protocol):
    """A module whose forward can yield while its transfers are in flight (an MoE block)."""

    def stages(self, x: torch.Tensor) -> Staged[torch.Tensor]: ...


def run_to_end(staged: Staged[T]) -> T:
    """Drive one staged computation to its result, doing nothing at its yield points."""
    while True:
        try:
            next(staged)
        except StopIteration as finished:
            return finished.value


def interleave(first: Staged[T], second: Staged[T]) -> tuple[T, T]:
    """Drive two staged computations, alternating at every yield point, `first` leading; their results.

    If one finishes earlier (it cannot when both run the same layers, as micro-batches of one step do),
    the other runs on alone: the schedule depends on the layers only, never on the data, so it is the
    same on every rank."""
    running = [first, second]
    results: list = [None, None]
    while any(g is not None for g in running):
        for index, staged in enumerate(running):
            if staged is None:
                continue
            try:
                next(staged)
            except StopIteration as finished:
                results[index] = finished.value
                running[index] = None
    return results[0], results[1]


def call_staged(module, x: torch.Tensor) -> Staged[torch.Tensor]:
    """`module(x)` as a staged computation: its own stages when it has them (an MoE block), else one call."""
    if isinstance(module, StagedModule):
        return (yield from module.stages(x))
    return module(x)
