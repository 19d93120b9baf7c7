"""Thin wrappers over torch.distributed collectives that work the same on gloo and NCCL.

Rows of mixed dtypes (hidden states, int32 expert ids, fp32 weights) travel as one uint8 tensor
per row, so each logical exchange is a single collective whatever the dtypes are (gloo lacks
some dtypes, e.g. bf16 in older releases; bytes it always has).

Each collective also has a `start_*` form (async_op=True) that returns a `Pending` of the same
result, for backends that overlap their transfers with compute (moe_runtime/dispatch/pending.py); the plain
form is the started one, waited on at once.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from moe_runtime.dispatch.pending import InFlight, Pending


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    dtype: torch.dtype
    width: int  # elements per row

    @property
    def nbytes(self) -> int:
        return self.width * self.dtype.itemsize


def pack_rows(*columns: torch.Tensor) -> torch.Tensor:
    """Tensors [S, w_i] of any dtypes -> uint8 [S, sum_i w_i * itemsize_i]."""
    return torch.cat([as_bytes(c) for c in columns], dim=1)


def unpack_rows(packed: torch.Tensor, specs: list[ColumnSpec]) -> list[torch.Tensor]:
    """Inverse of pack_rows: uint8 [S, B] -> one [S, w_i] tensor per spec."""
    out, start = [], 0
    for spec in specs:
        chunk = packed[:, start:start + spec.nbytes].contiguous()
        out.append(chunk.view(spec.dtype).reshape(packed.shape[0], spec.width))
        start += spec.nbytes
    if start != packed.shape[1]:
        raise ValueError(f"unpack_rows: specs cover {start} bytes per row, packed rows have "
                         f"{packed.shape[1]}")
    return out


def as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[S, ...] any dtype -> uint8 [S, row bytes] view (explicit width: S may be 0).

    A tensor with a size-1 last dimension counts as contiguous whatever that dimension's stride, and a
    `ones_like` of an expanded [T, 1] keeps stride 0 there, which a byte view refuses: such rows are copied
    with fresh strides."""
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    rows = rows.contiguous()
    if rows.dim() > 1 and rows.stride(-1) != 1:
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.view(torch.uint8).reshape(rows.shape[0], row_bytes)


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """send_counts [R] int64 (rows for each rank) -> recv_counts [R] (rows from each rank)."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts


def all_to_all_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group) -> torch.Tensor:
    """rows [S, ...] sent in rank order with uneven splits -> received rows [sum(recv), ...]."""
    return start_all_to_all_rows(rows, send_splits, recv_splits, group).wait()


def start_all_to_all_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                          group) -> Pending[torch.Tensor]:
    """`all_to_all_rows` started with async_op: the received rows once waited on."""
    send = as_bytes(rows)
    recv = torch.empty(sum(recv_splits), send.shape[1], dtype=torch.uint8, device=rows.device)
    work = dist.all_to_all_single(recv, send, group=group, output_split_sizes=recv_splits,
                                  input_split_sizes=send_splits, async_op=True)
    return InFlight(work, lambda: recv.view(rows.dtype).reshape(sum(recv_splits), *rows.shape[1:]),
                    keep_alive=(send, recv))


def all_gather_rows(rows: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """rows [M, ...] (same M on every rank) -> [world_size * M, ...] in rank order."""
    return start_all_gather_rows(rows, world_size, group).wait()


def start_all_gather_rows(rows: torch.Tensor, world_size: int, group) -> Pending[torch.Tensor]:
    """`all_gather_rows` started with async_op: the gathered rows once waited on."""
    send = as_bytes(rows)
    recv = torch.empty(world_size * send.shape[0], send.shape[1], dtype=torch.uint8,
                       device=rows.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(recv, send, group=group, async_op=True)
    return InFlight(work, lambda: recv.view(rows.dtype).reshape(world_size * rows.shape[0], *rows.shape[1:]),
                    keep_alive=(send, recv))


def all_gather_counts(count: int, world_size: int, group, device) -> list[int]:
    """Every rank's integer (e.g. its token count), in rank order."""
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    return all_gather_rows(mine.view(1, 1), world_size, group).view(-1).tolist()


def reduce_scatter_rows(rows: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """rows [world_size * M, H] summed over ranks -> this rank's [M, H] block."""
    return start_reduce_scatter_rows(rows, world_size, group).wait()


def start_reduce_scatter_rows(rows: torch.Tensor, world_size: int, group) -> Pending[torch.Tensor]:
    """`reduce_scatter_rows` started with async_op (a backend without it raises here, at the start)."""
    out = torch.empty(rows.shape[0] // world_size, *rows.shape[1:], dtype=rows.dtype,
                      device=rows.device)
    send = rows.contiguous()
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = scatter(out, send, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return InFlight(work, lambda: out, keep_alive=(send, out))


def all_reduce_slice(rows: torch.Tensor, rank: int, world_size: int, group) -> torch.Tensor:
    """Fallback for backends without reduce-scatter: all-reduce, keep this rank's block."""
    return start_all_reduce_slice(rows, rank, world_size, group).wait()


def start_all_reduce_slice(rows: torch.Tensor, rank: int, world_size: int,
                           group) -> Pending[torch.Tensor]:
    """`all_reduce_slice` started with async_op."""
    summed = rows.contiguous().clone()
    work = dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group, async_op=True)
    block = rows.shape[0] // world_size
    return InFlight(work, lambda: summed[rank * block:(rank + 1) * block], keep_alive=(summed,))
