"""triton is an optional dependency (`.[gpu]`, and `.[dev]` for its interpreter tests): every module of
every package imports without it, and a CPU engine still gets its kernels."""
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_runtime",)   # every folder of the repository imports under it (setup.py)
TRITON_ONLY = "moe_runtime.kernels.triton_impl"   # the Triton kernels themselves: imported only when asked for


def test_every_module_imports_with_triton_hidden():
    code = f"""
import importlib, pkgutil, sys
sys.modules["triton"] = None   # `import triton` now raises ImportError, as where it is not installed
names = []
for package_name in {PACKAGES!r}:
    package = importlib.import_module(package_name)
    names.append(package_name)
    for module in pkgutil.walk_packages(package.__path__, package_name + "."):
        if not module.name.startswith({TRITON_ONLY!r}):
            importlib.import_module(module.name)
            names.append(module.name)
from moe_runtime import kernels
from moe_runtime.kernels.kernel_set import triton_importable
assert not triton_importable()
kernels.get_kernels("cpu")
print(len(names))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert int(result.stdout.split()[-1]) > 50   # the walk found the modules


def test_triton_is_an_extra_not_a_dependency():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements):
        return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].strip() for r in requirements}

    assert "triton" not in names(project["dependencies"])
    assert {"triton", "deep-ep"} <= names(extras["gpu"])
    assert "triton" in names(extras["dev"])          # the Triton kernels' interpreter tests
    assert extras["deepep"] == ["moe-runtime[gpu]"]  # the old extra's name still works
