"""The CPU expert kernel (expert_mlp.cpp), compiled on first use for this machine and cached; None without a compiler.

`torch.utils.cpp_extension.load` builds it with -O3 -march=native (the vector units of the CPU it runs on: AVX2
and FMA here, AVX-512 where present) into ~/.cache/moe-runtime/cpu_native/<CPU flags digest>, once; later
processes (every rank, every checkout of the same source: the source is built from a copy in that directory)
load the cached library, and concurrent builds wait on torch's lock in that directory.
A machine without a C++ compiler, or a build that fails, gets None and one log line: the torch kernels serve.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("expert_mlp.cpp")
HEADERS = (Path(__file__).with_name("weight_dots.h"),   # included by SOURCE: copied beside it, hashed with it
           Path(__file__).with_name("int4_dots.h"))
CACHE = Path.home() / ".cache" / "moe-runtime" / "cpu_native"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast"]


def _cpu_digest() -> str:
    """What the build is specific to: the CPU's feature flags, the source, the compiler flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    texts = "".join(path.read_text() for path in (SOURCE, *HEADERS))
    digest = hashlib.sha256((flags + texts + " ".join(FLAGS)).encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def native_experts() -> ModuleType | None:
    """The compiled module (`silu_expert_mlp`), or None where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        directory = CACHE / _cpu_digest()
        directory.mkdir(parents=True, exist_ok=True)
        for original in (*HEADERS, SOURCE):   # the build names its source's path: one path for every checkout
            _place(original, directory / original.name)
        source = directory / SOURCE.name
        return load(name="moe_cpu_experts", sources=[str(source)], extra_cflags=FLAGS,
                    build_directory=str(directory), verbose=False)
    except Exception as exc:   # noqa: BLE001 - no compiler, no headers, a failed build: the torch path serves
        logger.warning("CPU expert kernel not built (%s: %s); the torch expert kernel serves", type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "")
        return None


def _place(original: Path, copy: Path) -> None:
    """`copy` made to hold `original`'s text, whole or not at all: ranks may start the build at once."""
    if copy.exists() and copy.read_text() == original.read_text():
        return
    staged = copy.with_name(f".{copy.name}.{os.getpid()}")
    staged.write_text(original.read_text())
    os.replace(staged, copy)


WEIGHT_TYPES = ("float", "c10::BFloat16", "int8_t", "c10::Float8_e4m3fn")   # the W the kernels instantiate


def compile_errors(march: str) -> str:
    """The compiler's errors for the vector code built for another CPU (`-march=x86-64-v4`: AVX-512), checked without
    code generation: how the paths this machine's CPU does not run are kept compiling ("" when none). The headers
    alone, their dots instantiated for every weight type: a few seconds, not the whole extension's torch headers."""
    from torch.utils.cpp_extension import include_paths

    unit = "".join([f'#include "{header.name}"\n' for header in HEADERS] + [
        f"template void moe_cpu::dot_some<{w}>(const {w}*, const float*, int64_t, int64_t, int64_t, float*);\n"
        for w in WEIGHT_TYPES] + [
        f"template void moe_cpu::int4_dot_rows<{rows}>(const moe_cpu::Int4Row&, const float*, int64_t, int64_t, "
        f"float*);\n" for rows in (1, 2, 3, 4)])
    includes = [f"-I{path}" for path in (HEADERS[0].parent, *include_paths())]
    command = ["g++", "-std=c++20", "-fsyntax-only", f"-march={march}", *includes, "-x", "c++", "-"]
    result = subprocess.run(command, input=unit, capture_output=True, text=True, check=False)
    return "" if result.returncode == 0 else result.stderr
