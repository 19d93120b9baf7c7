"""Package-level guarantees: lazy triton import, kernel family choice, no clash with HF's `kernels`."""
import importlib.metadata
import subprocess
import sys

import pytest
import torch

from kernels import KernelSet, get_kernels


def run_python(code, env=None):
    import os
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


def test_importing_kernels_does_not_import_triton():
    result = run_python("import sys, kernels; kernels.get_kernels('cpu'); print('triton' in sys.modules)")
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


def test_transformers_does_not_take_us_for_the_hf_kernels_hub():
    """transformers probes `import kernels` + the distribution version; ours must fall outside its range."""
    try:
        version = importlib.metadata.version("moe-runtime")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("moe-runtime is not pip-installed: the README's install step (pip install -e '.[dev]') comes first")
    assert version == "0.1.0"
    result = run_python("from transformers.utils.import_utils import is_kernels_available; "
                        "print(is_kernels_available())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
