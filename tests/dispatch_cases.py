"""Routing cases shared by the dispatch contract and the MoE seam's contract tests.

Deterministic per (scenario, world size, rank), so any rank can rebuild any other rank's case,
and an expert bank with its own per-expert SwiGLU oracle (no grouping code shared with the
dispatchers or kernels it checks).
"""

import dataclasses

import torch
import torch.nn.functional as F

from moe_runtime.dispatch import DispatchConfig
from deepep_emulation import EmulatedDeepEPBuffer
from moe_runtime.load_balancer import SlotGeometry

HIDDEN = 8
INTERMEDIATE = 6
TOP_K = 4
SLOTS_PER_RANK = 3      # < TOP_K: every token hits some rank more than once
MAX_TOKENS = 16         # bound for the low-latency backend, above every scenario's T
EXPERT_SEED = 1234

SCENARIOS = ["uneven", "zero_tokens", "all_empty", "zero_experts", "repeated_ranks", "masked"]
MULTI_RANK_BACKENDS = ["all_to_all", "all_to_all_no_dedup", "allgather", "deepep_normal",
                       "deepep_low_latency"]
DEEPEP_BACKENDS = ("deepep_normal", "deepep_low_latency")
DEEPEP_HIDDEN = 2048    # DeepEP moves bf16 rows only, and its low-latency kernels take a fixed list of sizes


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """The rows a backend's cases carry: DeepEP's (and its emulation's) are bf16 of a size it compiles."""

    hidden: int
    dtype: torch.dtype
    tolerance: float        # of the combined output against the float64 oracle, relative to its scale


def row_format(backend: str, dtype: torch.dtype = torch.float32) -> RowFormat:
    if backend in DEEPEP_BACKENDS or dtype == torch.bfloat16:
        return RowFormat(DEEPEP_HIDDEN if backend in DEEPEP_BACKENDS else HIDDEN, torch.bfloat16, 5e-2)
    return RowFormat(HIDDEN, dtype, 1e-5)


@dataclasses.dataclass
class Case:
    x: torch.Tensor         # [T, H]
    slot_ids: torch.Tensor  # [T, K] int64
    weights: torch.Tensor   # [T, K] float32


@dataclasses.dataclass
class Experts:
    w13: torch.Tensor  # [num_slots, 2I, H]
    w2: torch.Tensor   # [num_slots, H, I]

    def oracle(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w13[slot].t()).chunk(2, dim=1)
        return (F.silu(gate) * up) @ self.w2[slot].t()


def make_experts(num_slots: int, hidden: int = HIDDEN) -> Experts:
    gen = torch.Generator().manual_seed(EXPERT_SEED)
    scale = 0.3 * (HIDDEN / hidden) ** 0.5          # outputs of the same size whatever the hidden size
    return Experts(w13=scale * torch.randn(num_slots, 2 * INTERMEDIATE, hidden, generator=gen),
                   w2=0.3 * torch.randn(num_slots, hidden, INTERMEDIATE, generator=gen))


def _distinct_slots(num_tokens: int, choices: torch.Tensor, k: int, gen) -> torch.Tensor:
    rows = [choices[torch.randperm(choices.numel(), generator=gen)[:k]] for _ in range(num_tokens)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)


def make_case(scenario: str, world_size: int, rank: int, hidden: int = HIDDEN) -> Case:
    """Deterministic inputs of `rank`; any rank can rebuild any other rank's case. Rows are bf16 values (exact
    in every dtype the cases run in), so the rows a rank receives sum exactly to what was sent."""
    gen = torch.Generator().manual_seed(1000 * world_size + 10 * rank + SCENARIOS.index(scenario))
    num_slots = SLOTS_PER_RANK * world_size
    all_slots = torch.arange(num_slots)
    num_tokens = {"uneven": [5, 1, 9, 3][rank % 4],
                  "zero_tokens": 0 if rank % 2 else 6,
                  "all_empty": 0}.get(scenario, 7)
    if scenario == "zero_experts":
        # Only experts 0 and 1 of rank 0 are used: its expert 2 and every other rank's experts
        # receive nothing; the other top-k entries are masked.
        slots = torch.full((num_tokens, TOP_K), -1, dtype=torch.int64)
        slots[:, :2] = _distinct_slots(num_tokens, torch.tensor([0, 1]), 2, gen)
    elif scenario == "repeated_ranks":
        # All but one choice on one rank; token 0 even picks the same slot twice.
        home = torch.randint(0, world_size, (num_tokens,), generator=gen)
        slots = torch.empty(num_tokens, TOP_K, dtype=torch.int64)
        for t in range(num_tokens):
            on_home = torch.arange(SLOTS_PER_RANK) + int(home[t]) * SLOTS_PER_RANK
            slots[t, :SLOTS_PER_RANK] = on_home[torch.randperm(SLOTS_PER_RANK, generator=gen)]
            slots[t, SLOTS_PER_RANK:] = int(torch.randint(0, num_slots, (1,), generator=gen))
        if num_tokens:
            slots[0, 1] = slots[0, 0]
    else:
        slots = _distinct_slots(num_tokens, all_slots, TOP_K, gen)
        if scenario == "masked" and num_tokens:
            slots[torch.rand(slots.shape, generator=gen) < 0.3] = -1
            slots[0] = -1  # a token with no expert at all
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).float()
    return Case(x, slots, weights)


def dispatch_config(backend: str, world_size: int, rank: int, dtype=None,
                    device: str = "cpu", hidden_size: int | None = None,
                    fp8_activations: bool = False) -> DispatchConfig:
    """`backend` may also be "all_to_all_no_dedup" (all_to_all sending one row per (token, k)). The dtype and
    hidden size default to the backend's `row_format`."""
    rows = row_format(backend, dtype or torch.float32)
    dtype = dtype or rows.dtype
    hidden_size = hidden_size or rows.hidden
    send_once = backend != "all_to_all_no_dedup"
    backend = "all_to_all" if backend == "all_to_all_no_dedup" else backend
    return DispatchConfig(backend, SlotGeometry(SLOTS_PER_RANK * world_size, world_size), rank, group=None,
                          hidden_size=hidden_size, dtype=dtype, device=device, max_tokens_per_rank=MAX_TOKENS,
                          send_once=send_once, deepep_buffer_cls=EmulatedDeepEPBuffer,
                          fp8_activations=fp8_activations)
