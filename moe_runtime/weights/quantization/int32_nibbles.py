"""int4 codes packed eight to an int32 word: the storage AWQ, GPTQ and compressed-tensors share, each along its own
dimension and AWQ in its own order. Nibble i of a word is its bits 4i..4i+3 (the low nibble first)."""
from __future__ import annotations

import sys

import torch

NIBBLES_PER_WORD = 8
NIBBLE_BITS = 4
BYTES_PER_WORD = 4


def unpack_words(words: torch.Tensor, dim: int, positions: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> uint8 codes 0..15 with `dim` eight times longer: word j along `dim` holds codes 8j..8j+7.

    `positions[i]`: where among its word's eight codes nibble i belongs (AWQ's interleaved order); None: at i."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed int4 words must be int32, got {words.dtype}")
    dim = dim % words.dim()
    nibbles = word_nibbles(words)                                                        # [..., 8]: nibble i
    if positions is not None:
        nibbles = nibbles[..., inverse_positions(positions)]                             # [..., 8]: code i
    return nibbles.movedim(-1, dim + 1).flatten(dim, dim + 1)                            # [..., 8W, ...]


def word_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [...] -> uint8 [..., 8], nibble i of each word at i. On a little-endian host a word's bytes are its
    nibbles two by two (byte b: nibbles 2b low, 2b + 1 high), so only uint8 temporaries are made (a few bytes a
    word; shifting the int32 words made two int32 [..., 8] ones, 32 bytes a word each)."""
    if sys.byteorder == "little":
        data = words.contiguous().view(torch.uint8).unflatten(-1, (-1, BYTES_PER_WORD))   # [..., 4]: byte b
        return torch.stack((data & 0xF, data >> NIBBLE_BITS), dim=-1).flatten(-2)         # [..., 8]
    shifts = torch.arange(0, 32, NIBBLE_BITS, dtype=torch.int32, device=words.device)     # [8]
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def inverse_positions(positions: tuple[int, ...]) -> list[int]:
    """The nibble holding each code: the inverse permutation of `positions`."""
    inverse = [0] * len(positions)
    for nibble, position in enumerate(positions):
        inverse[position] = nibble
    return inverse
