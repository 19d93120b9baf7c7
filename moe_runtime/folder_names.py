"""The repository's top-level folders are imported as `moe_runtime.<folder>`, never as top-level names.

`dispatch/`, `attention_dp/`, `kernels/`, `load_balancer/` and `server/` sit beside `moe_runtime/` in the
repository (the project's layout), and setup.py maps each to `moe_runtime.<folder>` for wheels and
editable installs alike. A process whose `sys.path` holds the repository root (`python -m pytest` or
`python -m ...` started there) could still find them under their bare names, and `kernels` is also the name
of Hugging Face's kernel hub package, which transformers imports whenever it is installed: ours would
shadow it. Each folder's `__init__.py` therefore starts by calling `yield_bare_name(__name__, __file__)`,
which, when the folder is being imported under its bare name, hands that name to the distribution that
owns it (or reports it missing, as Python would), so the repository root on `sys.path` changes nothing.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

NAMESPACE = "moe_runtime"


def yield_bare_name(module_name: str, init_file: str) -> None:
    """Called first by each mapped folder's `__init__`; returns at once when imported as `moe_runtime.<folder>`.

    Imported under its bare name, the folder's module is replaced in `sys.modules` by the package of that name
    found on `sys.path` outside this repository (Hugging Face's `kernels`, say), which the importer then
    returns; with none, ModuleNotFoundError, as for any missing module.
    """
    if module_name.startswith(NAMESPACE + "."):
        return
    repository_root = Path(init_file).resolve().parent.parent
    elsewhere = [entry for entry in sys.path if not is_source_tree(Path(entry or "."), repository_root)]
    spec = importlib.machinery.PathFinder.find_spec(module_name, elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {module_name!r} (this repository's {module_name}/ folder is "
                                  f"imported as {NAMESPACE}.{module_name})", name=module_name)
    owner = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = owner
    try:
        spec.loader.exec_module(owner)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise


def is_source_tree(entry: Path, repository_root: Path) -> bool:
    """This repository's root, or another checkout of moe-runtime (whose folders would answer the same way)."""
    return entry.resolve() == repository_root or (entry / NAMESPACE / "folder_names.py").is_file()
