"""gpu_check part `environment`: what this run ran on, and whether the other parts can import what they need;
and, run as a script here, the download of the wheels a GPU machine without network needs.

The lent GPU machine has no network: packages its image lacks (the serving stack, this project's
transformers) travel as wheels. A missing one fails the `packages` check by name, so the failures it
causes later read as what they are.

The wheels: a GPU image usually has CUDA torch, triton and an older transformers but not the serving
stack (fastapi, uvicorn, pydantic, msgspec, pyzmq, plotly). `download_wheels` writes their wheels, and
transformers (+ regex, which it needs at that version) at the versions installed on this machine (the
ones the tests were written against), for the GPU machine's Python, into bench/.cache/wheels
(git-ignored); `bench/gpu_check.sh` installs whatever it finds there into a scratch directory put
first on PYTHONPATH. Nothing is downloaded there.

    python -m bench.gpu_check.environment                    # wheels for CPython 3.12 on manylinux x86_64
    python -m bench.gpu_check.environment --python-version 3.11
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

from .report import Outcome, RunMode, judged, passed

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "bench" / ".cache" / "wheels"
# import name -> distribution name: every part's needs (the serving stack for `serve`, pytest for
# `kernel_cases`, transformers for the oracle and the benchmarks).
REQUIRED_MODULES = {
    "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
    "numpy": "numpy", "triton": "triton", "fastapi": "fastapi", "starlette": "starlette",
    "pydantic": "pydantic", "pydantic_core": "pydantic_core", "uvicorn": "uvicorn", "msgspec": "msgspec",
    "zmq": "pyzmq", "plotly": "plotly", "prometheus_client": "prometheus_client", "httpx": "httpx",
    "pytest": "pytest",
}
# On the GPU these are imported, not only found: carried wheels with compiled extensions built for
# another Python fail only on import. The rest, and everything in the dry run (the dev machine's
# packages are the test suite's), are looked up without importing: imports cost seconds.
IMPORTED_ON_GPU = ("torch", "transformers", "fastapi", "pydantic_core", "uvicorn", "msgspec", "zmq")


def module_version(name: str, distribution: str, import_it: bool) -> str:
    if import_it:
        importlib.import_module(name)
    elif importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"no module named {name!r}")
    return importlib.metadata.version(distribution)


class EnvironmentPart:
    def __init__(self, mode: RunMode):
        self.mode = mode

    def check_names(self) -> list[str]:
        return ["packages", "device"]

    def run(self, name: str) -> Outcome:
        return {"packages": self.packages, "device": self.device}[name]()

    def close(self) -> None:
        pass

    def packages(self) -> Outcome:
        versions, missing = {}, []
        for module, distribution in REQUIRED_MODULES.items():
            try:
                versions[module] = module_version(module, distribution,
                                                 not self.mode.dry_run and module in IMPORTED_ON_GPU)
            except Exception as exc:  # noqa: BLE001 - any import failure is a missing package here
                missing.append(f"{distribution} ({type(exc).__name__}: {str(exc)[:120]})")
        from moe_runtime import kernels

        problems = []
        if missing:
            problems.append("cannot import: " + ", ".join(missing) + " -- on a machine without network, carry "
                            "them: `python -m bench.gpu_check.environment` here, then run with carry bench/.cache/wheels")
        if Path(kernels.__file__).resolve().parent != REPO / "moe_runtime" / "kernels":
            problems.append(f"`moe_runtime.kernels` is {kernels.__file__}, not this repo's moe_runtime/kernels/")
        return judged(problems, python=sys.version.split()[0], executable=sys.executable, versions=versions,
                      platform=platform.platform(), cpu_count=os.cpu_count(),
                      load_average=[round(x, 2) for x in os.getloadavg()],   # wall times read against this
                      triton_interpret=os.environ.get("TRITON_INTERPRET"), pythonpath=os.environ.get("PYTHONPATH"))

    def device(self) -> Outcome:
        import torch

        info = {"device": self.mode.device, "cuda_available": torch.cuda.is_available(),
                "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                "torch_cuda": torch.version.cuda}
        if info["cuda_available"]:
            try:                      # descriptive only: never lose `cuda_available` to a failure here
                props = torch.cuda.get_device_properties(0)
                info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                            memory_gib=round(props.total_memory / 2**30, 1),
                            multiprocessors=props.multi_processor_count,
                            names=[torch.cuda.get_device_name(i) for i in range(info["cuda_device_count"])])
                info["nccl"] = str(torch.cuda.nccl.version())
            except Exception as exc:  # noqa: BLE001
                info["properties_error"] = f"{type(exc).__name__}: {exc}"
        if self.mode.dry_run:
            return passed(**info, note="dry run: CPU only, no GPU needed")
        return judged([] if info["cuda_available"] else ["no CUDA device visible to torch"], **info)


# -------------------------------------------------------------------------------------- the wheels it needs

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


def download_wheels() -> int:
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
    sys.exit(download_wheels())
