"""The parts of `bench/gpu_check.py`, in the order they run, with their time budgets.

`budget_s` is what a part should take (printed beside its elapsed time: a part far over it is a
finding in itself); `timeout_s` is the hard limit after which its process group is killed and its
unfinished checks are recorded as `timeout` / `not_run`. GPU figures are estimates for one H200 with
a cold Triton cache (every kernel variant compiles once; not yet measured: no GPU so far); dry-run
figures were measured on the 2-core CPU dev machine shared with other jobs (load average 7-8).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartSpec:
    name: str
    module: str                 # bench module with build_part(mode) -> Part
    summary: str
    gpu_budget_s: float
    gpu_timeout_s: float
    dry_budget_s: float
    dry_timeout_s: float
    triton_interpreter: bool = False   # dry run: the child starts with TRITON_INTERPRET=1

    def budget_s(self, dry_run: bool) -> float:
        return self.dry_budget_s if dry_run else self.gpu_budget_s

    def timeout_s(self, dry_run: bool) -> float:
        return self.dry_timeout_s if dry_run else self.gpu_timeout_s


PARTS: tuple[PartSpec, ...] = (
    PartSpec("environment", "gpu_check_environment",
             "versions, the device, the packages the other parts import",
             gpu_budget_s=10, gpu_timeout_s=60, dry_budget_s=8, dry_timeout_s=60),
    PartSpec("kernels", "gpu_check_kernels",
             "every Triton kernel vs its torch twin at DeepSeek-V3 shapes (bf16; routing also fp32)",
             gpu_budget_s=80, gpu_timeout_s=150, dry_budget_s=15, dry_timeout_s=60, triton_interpreter=True),
    PartSpec("parity", "gpu_check_parity",
             "LLM(device=...) greedy tokens vs transformers on every tiny architecture: fp32 exact, bf16 close; ep=2",
             gpu_budget_s=100, gpu_timeout_s=170, dry_budget_s=60, dry_timeout_s=120),
    PartSpec("serve", "gpu_check_serve",
             "moe-serve --device on the demo model answers a completion",
             gpu_budget_s=40, gpu_timeout_s=100, dry_budget_s=25, dry_timeout_s=90),
    PartSpec("moe_layer", "gpu_check_moe_layer",
             "bench/bench_moe_layer.py: one MoE layer vs transformers' block (grouped_mm, eager)",
             gpu_budget_s=50, gpu_timeout_s=120, dry_budget_s=20, dry_timeout_s=60),
    PartSpec("offline", "gpu_check_offline",
             "offline generation vs transformers generate (bench_offline.py's checkpoint and prompts; bf16 "
             "and --quantization fp8)",
             gpu_budget_s=70, gpu_timeout_s=140, dry_budget_s=45, dry_timeout_s=90),
    PartSpec("captured", "gpu_check_captured",
             "--enable-torch-compile: decode replayed as CUDA graphs gives the eager tokens (bucket 4, a pad row), "
             "no graph skipped; ms per token captured vs eager",
             gpu_budget_s=90, gpu_timeout_s=180, dry_budget_s=40, dry_timeout_s=120),
    # Last: the four checks the GPU run exists for come first; this one takes what time is left.
    PartSpec("kernel_cases", "gpu_check_kernel_cases",
             "tests/triton_kernel_cases.py compiled, bf16 + fp32 (empty batches, masked slots, partial tiles)",
             gpu_budget_s=60, gpu_timeout_s=120, dry_budget_s=20, dry_timeout_s=60, triton_interpreter=True),
)

PART_NAMES = tuple(part.name for part in PARTS)


def select_parts(only: list[str] | None, skip: list[str] | None) -> list[PartSpec]:
    """The parts to run: `environment` always (the report needs it), then `only` minus `skip`."""
    for name in (only or []) + (skip or []):
        if name not in PART_NAMES:
            raise ValueError(f"unknown part {name!r}; parts: {', '.join(PART_NAMES)}")
    chosen = [p for p in PARTS if (not only or p.name in only) and p.name not in (skip or [])]
    if PARTS[0] not in chosen:
        chosen.insert(0, PARTS[0])
    return chosen
