"""Expert grouping for the grouped GEMM: a stable sort by expert, padded per expert to BLOCK_M.

`align_block_size` is the `moe_align_block_size` of this runtime: from topk ids it builds both the
unpadded sorted order (a `PermutePlan`) and a `BlockSchedule` whose segments are padded to BLOCK_M
rows so every GEMM tile belongs to exactly one expert. `schedule_from_counts` builds the same
schedule for rows that are already grouped (the contiguous layout). None of this syncs with the
host; only `permute_by_expert` reads N back to size its outputs. The masked layout (DeepEP
low-latency) needs no schedule at all: its GEMM tiles a fixed grid and reads the counts itself
(masked_layout.py), so it neither fills a [P] schedule nor builds one per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..permute import PermutePlan, offsets_from_counts


@dataclass
class BlockSchedule:
    padded_rows: torch.Tensor    # [P] int64: source row of each padded slot, -1 for padding
    block_expert: torch.Tensor   # [P // block_m] int32: expert of each BLOCK_M tile, -1 for unused tiles
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]

    @property
    def num_slots(self) -> int:
        """Rows of an intermediate tensor in padded-slot order."""
        return self.padded_rows.shape[0]


@dataclass
class AlignedPairs:
    counts: torch.Tensor          # [E] int64
    sorted_flat: torch.Tensor     # [T*K] int64: flat (token, k) index of each sorted row, -1 past N
    schedule: BlockSchedule       # padded_rows hold flat (token, k) indices
    padded_slot: torch.Tensor     # [T*K] int64: padded row holding each (token, k) pair, -1 if dropped


def padded_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / block_m) * block_m, rounded to whole tiles."""
    return triton.cdiv(num_rows + num_experts * (block_m - 1), block_m) * block_m


@triton.jit
def padded_start_of(counts_ptr, expert, num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """(unpadded start, padded start, count) of `expert`'s segment, from all experts' counts."""
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    before = experts < expert
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    return tl.sum(tl.where(before, counts, 0), axis=0), tl.sum(tl.where(before, padded, 0), axis=0), count


@triton.jit
def count_pairs_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        total += (ids == expert).to(tl.int64)
    tl.store(counts_ptr + expert, tl.sum(total, axis=0))


@triton.jit
def place_pairs_kernel(
    ids_ptr, counts_ptr, sorted_flat_ptr, padded_rows_ptr, block_expert_ptr, padded_slot_ptr,
    num_pairs, num_experts, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
):
    expert = tl.program_id(0)
    start, padded_start, count = padded_start_of(counts_ptr, expert, num_experts, BLOCK_M, E_PAD)
    seen = 0
    for chunk in range(0, num_pairs, BLOCK):
        offs = chunk + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        mine = (ids == expert).to(tl.int32)
        rank = seen + tl.cumsum(mine, axis=0) - 1                        # stable: input order within expert
        hit = mine > 0
        tl.store(sorted_flat_ptr + start + rank, offs.to(tl.int64), mask=hit)
        tl.store(padded_rows_ptr + padded_start + rank, offs.to(tl.int64), mask=hit)
        tl.store(padded_slot_ptr + offs, (padded_start + rank).to(tl.int64), mask=hit)
        seen += tl.sum(mine, axis=0)
    for block in range(0, (count + BLOCK_M - 1) // BLOCK_M):
        tl.store(block_expert_ptr + padded_start // BLOCK_M + block, expert.to(tl.int32))


@triton.jit
def schedule_rows_kernel(
    counts_ptr, row_start_ptr, padded_rows_ptr, block_expert_ptr, num_experts,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
):
    expert = tl.program_id(0)
    _, padded_start, count = padded_start_of(counts_ptr, expert, num_experts, BLOCK_M, E_PAD)
    row_start = tl.load(row_start_ptr + expert)
    for block in range(0, (count + BLOCK_M - 1) // BLOCK_M):
        local = block * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(padded_rows_ptr + padded_start + local, row_start + local, mask=local < count)
        tl.store(block_expert_ptr + padded_start // BLOCK_M + block, expert.to(tl.int32))


def empty_schedule(capacity: int, block_m: int, device) -> BlockSchedule:
    return BlockSchedule(
        padded_rows=torch.full((capacity,), -1, dtype=torch.int64, device=device),
        block_expert=torch.full((capacity // block_m,), -1, dtype=torch.int32, device=device),
        block_m=block_m,
    )


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Group the (token, k) pairs of `topk_ids [T, K]` by expert; ids outside [0, E) are dropped."""
    flat_ids = topk_ids.reshape(-1).contiguous()                          # [T*K]
    num_pairs, device = flat_ids.shape[0], flat_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    sorted_flat = torch.full((num_pairs,), -1, dtype=torch.int64, device=device)
    padded_slot = torch.full((num_pairs,), -1, dtype=torch.int64, device=device)
    schedule = empty_schedule(padded_capacity(num_pairs, num_experts, block_m), block_m, device)
    if num_pairs and num_experts:
        block = min(1024, triton.next_power_of_2(num_pairs))
        count_pairs_kernel[(num_experts,)](flat_ids, counts, num_pairs, BLOCK=block)
        place_pairs_kernel[(num_experts,)](
            flat_ids, counts, sorted_flat, schedule.padded_rows, schedule.block_expert, padded_slot,
            num_pairs, num_experts, BLOCK=block, BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts),
        )
    return AlignedPairs(counts=counts, sorted_flat=sorted_flat, schedule=schedule, padded_slot=padded_slot)


def schedule_from_counts(counts: torch.Tensor, row_start: torch.Tensor, num_rows: int, block_m: int) -> BlockSchedule:
    """Tile rows already grouped by expert: expert e owns rows row_start[e] .. row_start[e]+counts[e]-1."""
    num_experts = counts.shape[0]
    schedule = empty_schedule(padded_capacity(num_rows, num_experts, block_m), block_m, counts.device)
    if num_rows and num_experts:
        schedule_rows_kernel[(num_experts,)](
            counts.contiguous(), row_start.to(torch.int64).contiguous(), schedule.padded_rows,
            schedule.block_expert, num_experts, BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts),
        )
    return schedule


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int) -> PermutePlan:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    aligned = align_block_size(topk_ids, num_experts, block_m=16)
    offsets = offsets_from_counts(aligned.counts)
    flat_index = aligned.sorted_flat[: int(offsets[-1])]                  # host sync: N sizes the plan
    return PermutePlan(
        token_index=flat_index // max(topk_ids.shape[1], 1),
        flat_index=flat_index,
        counts=aligned.counts,
        offsets=offsets,
    )
