"""The import namespace: every folder of the repository is imported under `moe_runtime.*`.

The repository keeps its top-level folders (`dispatch/`, `attention_dp/`, `kernels/`, `load_balancer/`,
`server/` beside `moe_runtime/`), but none of them is a top-level import name: generic words such as
`kernels` or `server` are claimed by other distributions (Hugging Face's `kernels`, which transformers
depends on, shadowed ours). setuptools' `package_dir` maps each folder to `moe_runtime.<folder>`, for a
wheel and for an editable install alike (docs/design.md, "Import namespace").
"""
from setuptools import find_packages, setup

MAPPED_FOLDERS = ("dispatch", "attention_dp", "kernels", "load_balancer", "server")


def mapped_packages() -> list[str]:
    """Every package under moe_runtime/ and under each mapped folder, named as it is imported."""
    packages = find_packages(include=["moe_runtime", "moe_runtime.*"])
    for folder in MAPPED_FOLDERS:
        packages += [f"moe_runtime.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]
    return packages


setup(packages=mapped_packages(),
      package_dir={"moe_runtime": "moe_runtime", **{f"moe_runtime.{f}": f for f in MAPPED_FOLDERS}})
