"""Sampling draws made on the device from (seed, position, token id): exact arithmetic, the target
distribution, and the same tokens whatever batch a request shares."""
import random

import torch

from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.counter_noise import exponential_race, hash32, row_keys, uniform
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.sampler import Sampler


def reference_hash32(x: int) -> int:
    """lowbias32 on Python ints (mod 2^32): what the tensor version must compute exactly."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_tensor_hash_is_exact_32_bit_arithmetic():
    rng = random.Random(0)
    words = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(20_000)]
    assert hash32(torch.tensor(words, dtype=torch.int64)).tolist() == [reference_hash32(w) for w in words]


def test_uniforms_are_in_the_open_interval_and_differ_by_seed_and_position():
    keys = row_keys(torch.tensor([0, 0, 1, 2**63 - 1]), torch.tensor([5, 6, 5, 5]))
    assert len(set(keys.tolist())) == 4
    u = uniform(keys, 50_000)                                        # [4, 50000]
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_the_exponential_race_draws_from_the_given_distribution():
    """Chi-square over 40,000 draws (one per seed) of a fixed distribution: below the 99.9% critical value."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    draws = 40_000
    tokens = exponential_race(probs.expand(draws, -1), torch.arange(draws) * 7919 + 11, torch.full((draws,), 3))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[-1] == 0, "a token of probability 0 was drawn"
    expected = probs[:-1].double() * draws
    chi_square = float(((counts[:-1] - expected) ** 2 / expected).sum())
    assert chi_square < 20.52, f"chi-square {chi_square:.2f} over 5 degrees of freedom"   # 99.9% point: 20.52
    # and across positions of one seed, as a request's successive tokens
    tokens = exponential_race(probs.expand(draws, -1), torch.full((draws,), 42), torch.arange(draws))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    chi_square = float(((counts[:-1] - expected) ** 2 / expected).sum())
    assert chi_square < 20.52, f"chi-square {chi_square:.2f} over positions of one seed"


def _sequence(request_id: str, prompt: list[int], seed: int | None) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=seed), arrival=0)


def test_a_seeded_row_draws_the_same_token_in_any_batch_and_order():
    torch.manual_seed(0)
    logits = torch.randn(4, 500)                                    # [B, V]
    sampler = Sampler()
    seqs = [_sequence(f"r{i}", [1, 2, 3 + i], seed=1000 + i) for i in range(4)]
    together = sampler(logits, seqs).token_ids
    alone = [sampler(logits[i:i + 1], [seqs[i]]).token_ids[0] for i in range(4)]
    reversed_batch = sampler(logits.flip(0), seqs[::-1]).token_ids[::-1]
    assert together == alone == reversed_batch
    # a longer sequence samples the next position: another draw (same logits, same seed)
    draws = {sampler(logits[:1], [_sequence("r0", [1, 2, 3] + [9] * n, seed=1000)]).token_ids[0] for n in range(20)}
    assert len(draws) > 1


def test_unseeded_requests_draw_independently():
    logits = torch.zeros(1, 1000)                                   # uniform over 1000 tokens
    sampler = Sampler()
    draws = {sampler(logits, [_sequence(f"u{i}", [1], seed=None)]).token_ids[0] for i in range(20)}
    assert len(draws) > 10
