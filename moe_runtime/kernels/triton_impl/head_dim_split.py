"""A head dim as at most two power-of-two tiles, so attention kernels pad no head to the next power of two:
DeepSeek's absorbed MLA keys (576 = 512 latent + 64 rope) would otherwise load 1024 columns, 78% of
them zeros; 192 (MLA's expanded heads) would load 256."""
from __future__ import annotations

from dataclasses import dataclass

MIN_DOT = 16   # tl.dot's smallest tile side


@dataclass(frozen=True)
class HeadDimSplit:
    main: int          # the first `main` columns (a power of two, or the whole dim when it is below MIN_DOT)
    main_padded: int   # its tile width: a power of two >= MIN_DOT
    tail: int          # the remaining columns (0: none)
    tail_padded: int   # its tile width: 0, or a power of two >= MIN_DOT

    @property
    def padded(self) -> int:
        return self.main_padded + self.tail_padded


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def head_dim_split(head_dim: int) -> HeadDimSplit:
    if head_dim < 1:
        raise ValueError(f"head dim must be positive, got {head_dim}")
    main = 1 << (head_dim.bit_length() - 1)          # the largest power of two <= head_dim
    tail = head_dim - main
    if tail and _next_power_of_2(head_dim) <= MIN_DOT:   # small dims: one padded tile is no waste worth a second
        main, tail = head_dim, 0
    main_padded = max(MIN_DOT, _next_power_of_2(main))
    return HeadDimSplit(main, main_padded, tail, max(MIN_DOT, _next_power_of_2(tail)) if tail else 0)
