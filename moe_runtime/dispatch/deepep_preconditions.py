"""What DeepEP's kernels accept, checked before a DeepEP buffer is made.

DeepEP compiles its kernels for bfloat16 rows only (its `SWITCH_TYPES`; FP8 dispatch is bf16 quantized
inside or a (float8, scales) pair), and its low-latency kernels for a fixed list of hidden sizes (its
`SWITCH_HIDDEN`): any other dtype or size fails a host assertion inside the first dispatch on the GPU.
The normal kernels move rows as 16-byte words, so a bf16 row must be a whole number of them.

`deepep_refusal` says why a mode cannot run (None when it can): 'auto' then falls back with one log line,
an explicit `--a2a-backend deepep` is refused with the reason, and the tests' DeepEP emulation holds its
callers to the same rules.
"""
from __future__ import annotations

import torch

DEEPEP_DTYPE = torch.bfloat16
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
NORMAL_ROW_ALIGNMENT_BYTES = 16          # rows travel as int4 words

MODE_NORMAL = "normal"
MODE_LOW_LATENCY = "low_latency"


def deepep_refusal(mode: str, dtype: torch.dtype, hidden_size: int | None) -> str | None:
    """Why DeepEP's `mode` cannot move rows of `hidden_size` (None: not checked) in `dtype`; None when it can."""
    if dtype != DEEPEP_DTYPE:
        return f"DeepEP moves bfloat16 rows only, the model runs in {str(dtype).removeprefix('torch.')} (--dtype bfloat16)"
    if hidden_size is None:
        return None
    if mode == MODE_LOW_LATENCY and hidden_size not in LOW_LATENCY_HIDDEN_SIZES:
        return (f"DeepEP's low-latency kernels are built for hidden sizes {list(LOW_LATENCY_HIDDEN_SIZES)}, "
                f"the model's is {hidden_size}")
    if (hidden_size * dtype.itemsize) % NORMAL_ROW_ALIGNMENT_BYTES:
        return (f"DeepEP moves rows in {NORMAL_ROW_ALIGNMENT_BYTES}-byte words; a hidden size of {hidden_size} "
                f"in bfloat16 is not a whole number of them")
    return None
