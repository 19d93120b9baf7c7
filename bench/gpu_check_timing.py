"""Wall-clock timing of a device call: best of a few runs after a warm-up, synchronized on CUDA.

Best-of, not mean: on a shared machine noise only ever adds time. Figures are reported as ratios
against the alternative (the torch twin, transformers), never asserted.
"""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_ms(fn, device: torch.device | str, repeats: int = 5) -> float:
    fn()                                                   # warm-up (and Triton's compile)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - started) * 1e3)
    return best
