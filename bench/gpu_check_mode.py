"""How a `gpu_check` run is set up: on the GPU, or the CPU rehearsal (`--dry-run`), and how big.

The orchestrator passes this to every part's child process as JSON; parts read the device and the
dtypes from here, so the dry run goes through the same code with other values, never other code.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RunMode:
    dry_run: bool          # CPU rehearsal: device cpu, Triton in its interpreter, small shapes
    tiny: bool             # the smallest meaningful subset (the dry-run test uses it)
    work_dir: str          # scratch space of this run: checkpoints, server logs, benchmark output

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    @property
    def kernel_low_precision(self) -> str:
        """The 16-bit dtype the Triton kernels are checked in. On the GPU bf16 (what models run in);
        in the dry run fp16, because the Triton interpreter's `tl.dot` gives wrong results in bf16
        (measured: fused_moe off by 1e10) while fp16 works (tests/triton_kernel_cases.py does the same)."""
        return "float16" if self.dry_run else "bfloat16"

    @property
    def label(self) -> str:
        return "dry_run" if self.dry_run else "gpu"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunMode":
        return cls(**json.loads(text))
