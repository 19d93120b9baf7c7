"""Download, here, the wheels a GPU machine without network needs for bench/gpu_check.sh.

A GPU image usually has CUDA torch, triton and an older transformers but not the serving stack
(fastapi, uvicorn, pydantic, msgspec, pyzmq, plotly). This writes their wheels, and transformers
(+ regex, which it needs at that version) at the versions installed on this machine (the ones the
tests were written against), for the GPU machine's Python, into bench/.cache/wheels (git-ignored);
`bench/gpu_check.sh` installs whatever it finds there into a scratch directory put first on
PYTHONPATH. Nothing is downloaded there.

    python bench/gpu_check_wheels.py                    # for CPython 3.12 on manylinux x86_64
    python bench/gpu_check_wheels.py --python-version 3.11
"""
from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

WHEELS = Path(__file__).resolve().parent / ".cache" / "wheels"
# Distributions to carry, pinned to this machine's versions. Their own dependencies that a CUDA
# image has anyway (anyio, h11, click, httpx, narwhals, packaging, typing-extensions, tokenizers,
# huggingface-hub, safetensors, numpy, pyyaml) are not carried.
CARRIED = ("fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
           "annotated-doc", "typing-extensions", "uvicorn", "msgspec", "pyzmq", "plotly", "prometheus-client",
           "transformers", "regex")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64", "manylinux1_x86_64")
SIZE_LIMIT_MIB = 48      # what travels with the working tree to the GPU machine is limited (64 MiB there)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--dest", default=str(WHEELS))
    args = parser.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", args.python_version, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    failed = []
    for pin in pins:               # one at a time: a wheel missing for one platform must not hide the others
        if subprocess.run(command + [pin], capture_output=True, text=True).returncode != 0:
            failed.append(pin)
    wheels = sorted(dest.glob("*.whl"))
    size_mib = sum(w.stat().st_size for w in wheels) / 2**20
    print("\n".join(f"  {w.name}" for w in wheels))
    print(f"{len(wheels)} wheels, {size_mib:.1f} MiB in {dest}")
    if failed:
        print(f"no wheel found for: {', '.join(failed)}", file=sys.stderr)
    if size_mib > SIZE_LIMIT_MIB:
        print(f"warning: {size_mib:.0f} MiB may not fit beside the working tree on the GPU machine", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
