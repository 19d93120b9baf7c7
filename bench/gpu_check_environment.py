"""gpu_check part `environment`: what this run ran on, and whether the other parts can import what they need.

The lent GPU machine has no network: packages its image lacks (the serving stack, this project's
transformers) travel as wheels (bench/gpu_check_wheels.py). A missing one fails here by name, so the
failures it causes later read as what they are.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path

from gpu_check_mode import RunMode
from gpu_check_outcome import Outcome, judged, passed

REPO = Path(__file__).resolve().parents[1]

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
        import kernels

        problems = []
        if missing:
            problems.append("cannot import: " + ", ".join(missing) + " -- on a machine without network, carry "
                            "them: `python bench/gpu_check_wheels.py` here, then run with carry bench/.cache/wheels")
        if Path(kernels.__file__).resolve().parent != REPO / "kernels":
            problems.append(f"`import kernels` found {kernels.__file__}, not this repo's kernels package")
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


def build_part(mode: RunMode) -> EnvironmentPart:
    return EnvironmentPart(mode)
