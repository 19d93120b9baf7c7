"""Package-level guarantees: lazy triton import, kernel family choice, no clash with HF's `kernels`."""
import importlib
import importlib.util
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


MAPPED_FOLDERS = ("dispatch", "attention_dp", "kernels", "load_balancer", "server")


def test_importing_from_the_repository_root_leaves_hf_kernels_its_name():
    """With the repository root first on sys.path (`python -m ...` started there), `import kernels` is still
    Hugging Face's hub package, which transformers imports; our folders answer only as moe_runtime.<folder>."""
    code = ("import importlib, kernels, moe_runtime.kernels, transformers.integrations.hub_kernels\n"
            "print(kernels.__file__)\nprint(moe_runtime.kernels.__file__)\n"
            f"for name in {[f for f in MAPPED_FOLDERS if f != 'kernels']!r}:\n"
            "    try:\n        importlib.import_module(name)\n    except ModuleNotFoundError as e:\n"
            "        print(e.name)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    hub_kernels, ours, *missing = result.stdout.split("\n")[:-1]
    assert Path(ours).resolve() == REPO_ROOT / "kernels" / "__init__.py"
    assert Path(hub_kernels).resolve().parent.parent.name == "site-packages", hub_kernels
    assert missing == [f for f in MAPPED_FOLDERS if f != "kernels"]


def test_a_bare_folder_name_is_handed_to_the_package_that_owns_it(tmp_path, monkeypatch):
    """yield_bare_name alone, in a tree of its own: `kernels` resolves past the repository to another owner,
    and a bare name nobody else owns is a plain ModuleNotFoundError."""
    repository, elsewhere = tmp_path / "repository", tmp_path / "elsewhere"
    for folder in ("kernels", "server"):
        (repository / folder).mkdir(parents=True)
        (repository / folder / "__init__.py").write_text(
            "from moe_runtime.folder_names import yield_bare_name\nyield_bare_name(__name__, __file__)\nOURS = True\n")
    (repository / "moe_runtime").mkdir()
    (repository / "moe_runtime" / "folder_names.py").write_text("")   # what marks a checkout of ours
    (elsewhere / "kernels").mkdir(parents=True)
    (elsewhere / "kernels" / "__init__.py").write_text("OWNER = 'elsewhere'\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    monkeypatch.syspath_prepend(str(repository))
    for name in ("kernels", "server"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("kernels")
    assert module.OWNER == "elsewhere" and not hasattr(module, "OURS")
    assert sys.modules["kernels"] is module
    with pytest.raises(ModuleNotFoundError) as missing:
        importlib.import_module("server")
    assert missing.value.name == "server" and "server" not in sys.modules
    monkeypatch.delitem(sys.modules, "kernels")


def test_every_folder_is_a_package_under_moe_runtime():
    """setup.py's mapping covers each folder with an __init__.py, and each starts with the bare-name guard."""
    packages = set(setup_packages())
    for folder in MAPPED_FOLDERS:
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO_ROOT).as_posix().replace("/", ".")
            assert f"moe_runtime.{relative}" in packages, relative
        head = (REPO_ROOT / folder / "__init__.py").read_text()
        assert "yield_bare_name(__name__, __file__)" in head, folder


def setup_packages() -> list[str]:
    spec = importlib.util.spec_from_file_location("moe_runtime_setup", REPO_ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    source = (REPO_ROOT / "setup.py").read_text().split("\nsetup(")[0]   # the listing, without running setup()
    exec(compile(source, str(REPO_ROOT / "setup.py"), "exec"), module.__dict__)
    return module.mapped_packages()
