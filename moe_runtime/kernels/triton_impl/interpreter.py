"""Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1, the CPU tests) rather than compiled."""
from __future__ import annotations

import os

import triton


def running_in_interpreter() -> bool:
    knobs = getattr(triton, "knobs", None)            # triton >= 3.4; older releases read the env var
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
