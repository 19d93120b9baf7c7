"""Random numbers for sampling that depend only on (seed, position, token id), made on the device.

A request's draw at position p is `argmax_v probs[v] / E[v]` with `E[v]` exponential noise (the
exponential race: the same distribution as a categorical draw from `probs`, and what vLLM's GPU
sampler does). Here `E[v] = -log(u)` and `u` is a uniform number computed from a hash of the request's
seed, the position being sampled and `v`, with integer tensor ops on whatever device the logits are on:

- no host read and no per-request generator state: a batch of rows draws in a few tensor ops, and a
  captured decode step can hold it;
- the same seed gives the same tokens whatever batch the request shares, on CPU or GPU, after a
  preemption (the recompute samples the same positions) or a P/D hand-off (the decode side continues
  at the next position): there is no stream of numbers to carry along.

The hash is 32-bit "lowbias32" (Chris Wellons' integer hash) applied in rounds; every multiply is split
in 16-bit halves so that no int64 product overflows (signed overflow is not something to rely on).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
UNIFORM_BITS = 24            # float32 holds 24 significant bits: u in (0, 1) on a 2^-24 grid


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2^32 for int64 `a` in [0, 2^32) and a constant `b` < 2^32, without int64 overflow."""
    low, high = b & 0xFFFF, b >> 16
    return (a * low + (((a * high) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 `x` in [0, 2^32): a bijection of 32-bit words with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row [S] from its seed [S] (int64, >= 0) and the position it samples [S]."""
    key = hash32(seeds & MASK32)
    key = hash32(key ^ ((seeds >> 32) & MASK32))
    return hash32(key ^ hash32((positions + GOLDEN32) & MASK32))


def unit_interval(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (int64 in [0, 2^32)) as float32 numbers in (0, 1) on a 2^-24 grid."""
    bits = words >> (32 - UNIFORM_BITS)
    return (bits.to(torch.float32) + 0.5) * (2.0 ** -UNIFORM_BITS)


def uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), float32 [S, V]: one per (row key [S], token id)."""
    token = hash32(torch.arange(vocab_size, device=keys.device, dtype=torch.int64))        # [V]
    return unit_interval(hash32(keys[:, None] ^ token[None, :]))                          # [S, V]


def stream_uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One uniform number in (0, 1) per row [S], keyed by its seed, position and `stream` (a 32-bit constant
    naming what the number decides): a draw beside the position's token noise, not one of its words."""
    keys = hash32(row_keys(seeds, positions) ^ (stream & MASK32))                         # [S]
    return unit_interval(hash32(keys ^ GOLDEN32))


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token id per row [S]: a draw from each row of `probs` [S, V] keyed by its seed and position."""
    noise = -torch.log(uniform(row_keys(seeds, positions), probs.shape[-1]))            # [S, V] Exp(1)
    return (probs / noise).argmax(dim=-1)
