"""Package-level guarantees: lazy triton import, kernel family choice, no clash with HF's `kernels`."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_runtime.kernels import KernelSet, get_kernels

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(code, env=None):
    import os
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


def test_importing_kernels_does_not_import_triton():
    result = run_python("import sys; from moe_runtime import kernels; kernels.get_kernels('cpu'); print('triton' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_auto_choice_and_overrides(monkeypatch):
    monkeypatch.delenv("MOE_KERNELS", raising=False)
    assert get_kernels(torch.device("cpu")).name == "torch"
    assert get_kernels("cpu", "reference").name == "reference"
    monkeypatch.setenv("MOE_KERNELS", "reference")
    assert get_kernels("cpu").name == "reference"
    assert get_kernels("cpu", "torch").name == "torch"       # explicit choice beats the env var
    monkeypatch.setenv("MOE_KERNELS", "fastest")
    with pytest.raises(ValueError, match="MOE_KERNELS"):
        get_kernels("cpu")
    with pytest.raises(ValueError, match="prefer"):
        get_kernels("cpu", "cuda-graphs")


def test_kernel_sets_expose_every_operation():
    for family in ("torch", "reference"):
        kernels = get_kernels("cpu", family)
        assert isinstance(kernels, KernelSet)
        for field in KernelSet.__dataclass_fields__:
            assert getattr(kernels, field) is not None, field


RUNTIME_PARTS = ("dispatch", "attention_dp", "kernels", "load_balancer", "server")


def test_moe_runtime_is_the_only_import_package_of_the_repository():
    """Generic names (`kernels`, `server`, ...) belong to other distributions (Hugging Face's `kernels`, which
    transformers imports): every part of the runtime lives under moe_runtime/, and nothing else at the root
    (tests/ and bench/ are not packages of the distribution) is importable under a bare name of ours."""
    top_level = {path.parent.name for path in REPO_ROOT.glob("*/__init__.py")}
    assert top_level == {"moe_runtime"}, top_level
    for part in RUNTIME_PARTS:
        assert (REPO_ROOT / "moe_runtime" / part / "__init__.py").is_file(), part


def test_importing_from_the_repository_root_leaves_hf_kernels_its_name():
    """With the repository root first on sys.path (`python -m ...` started there), `import kernels` is still
    Hugging Face's hub package, which transformers imports; ours answer only as moe_runtime.<part>."""
    code = ("import importlib, kernels, moe_runtime.kernels, transformers.integrations.hub_kernels\n"
            "print(kernels.__file__)\nprint(moe_runtime.kernels.__file__)\n"
            f"for name in {[f for f in RUNTIME_PARTS if f != 'kernels']!r}:\n"
            "    try:\n        importlib.import_module(name)\n    except ModuleNotFoundError as e:\n"
            "        print(e.name)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    hub_kernels, ours, *missing = result.stdout.split("\n")[:-1]
    assert Path(ours).resolve() == REPO_ROOT / "moe_runtime" / "kernels" / "__init__.py"
    assert Path(hub_kernels).resolve().parent.parent.name == "site-packages", hub_kernels
    assert missing == [f for f in RUNTIME_PARTS if f != "kernels"]
