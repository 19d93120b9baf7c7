"""The packages of `moe_runtime` form stages, and no module imports from a stage above its own.

The stage table below is the one place the order is written down (docs/design.md shows it). A stage is one or
more packages (a subpackage may sit in a stage of its own, below its parent: `disaggregation.kv_transfer`);
a module belongs to the stage of the longest entry that names it or a package above it. A module may import
its own stage and any stage below; an import of a higher stage fails the test with the file, the line and both
stages.

Every import counts: top-level, function-local, and those under `if TYPE_CHECKING:` (a type named from a
higher stage still couples the two: the lower one cannot be read, or moved, without the higher).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moe_runtime"

# Bottom to top. Each entry is a package (or the top-level module `errors`) of moe_runtime.
STAGES: list[tuple[str, list[str]]] = [
    ("errors", ["errors"]),
    ("config", ["config", "security"]),
    ("kernel libraries", ["kernels", "dispatch", "load_balancer"]),
    ("weights", ["weights"]),
    ("layers", ["layers"]),
    ("moe", ["moe"]),
    ("sampling", ["sampling"]),
    ("kv transfer wire", ["disaggregation.kv_transfer"]),
    ("records", ["records"]),
    ("kv tiers", ["kv_tiers"]),
    ("kv blocks", ["kv_blocks"]),
    ("models", ["models"]),
    ("execution", ["execution"]),
    ("speculative", ["speculative"]),
    ("disaggregation", ["disaggregation"]),
    ("engine", ["engine"]),
    ("attention_dp", ["attention_dp"]),
    ("processes", ["processes"]),
    ("planner", ["planner"]),
    ("front", ["front"]),
    ("planner calibration", ["planner.calibration"]),   # runs engines through LLM to time them
    ("package root", [""]),          # moe_runtime/__init__.py: the lazy public names (LLM, SamplingParams, ...)
    ("demo", ["demo"]),
    ("server", ["server"]),
]


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    importer: str        # dotted module name of the file
    target: str          # dotted module (or package) imported


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path, source: str | None = None) -> list[Import]:
    """Every `moe_runtime` import in the file, at any depth (functions, `if TYPE_CHECKING:` blocks)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from moe_runtime import kernels` names a package; `from moe_runtime.x import y` names x (or x.y)
            targets = [f"{base}.{alias.name}" for alias in node.names] if base == "moe_runtime" else [base]
        else:
            continue
        found += [Import(path, node.lineno, name, t) for t in targets if t.split(".")[0] == "moe_runtime"]
    return found


def stage_of(module: str) -> tuple[int, str] | None:
    """(rank, stage name) of the longest stage entry covering `module`; None when no entry does."""
    best = None
    relative = module.split(".")[1:]
    for rank, (stage, entries) in enumerate(STAGES):
        for entry in entries:
            parts = entry.split(".") if entry else []
            covers = relative[: len(parts)] == parts and (parts or not relative)
            if covers and (best is None or len(parts) > best[2]):
                best = (rank, stage, len(parts))
    return None if best is None else best[:2]


def all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_stage():
    unplaced = [str(p.relative_to(PACKAGE.parent)) for p in all_modules() if stage_of(module_name(p)) is None]
    assert not unplaced, f"modules in no stage (add their package to STAGES): {unplaced}"


def test_every_stage_entry_names_a_package():
    for _, entries in STAGES:
        for entry in entries:
            base = PACKAGE.joinpath(*entry.split(".")) if entry else PACKAGE
            assert (base / "__init__.py").exists() or base.with_suffix(".py").exists(), f"no package {entry!r}"


def upward_imports() -> list[str]:
    found = []
    for path in all_modules():
        for imp in project_imports(path):
            (low, low_name), target = stage_of(imp.importer), stage_of(imp.target)
            if target is None:
                found.append(f"{imp.path.relative_to(PACKAGE.parent)}:{imp.line}: {imp.target} is in no stage")
            elif target[0] > low:
                found.append(f"{imp.path.relative_to(PACKAGE.parent)}:{imp.line}: stage '{low_name}' imports "
                             f"{imp.target} of the higher stage '{target[1]}'")
    return found


def test_no_import_reaches_a_higher_stage():
    found = upward_imports()
    assert not found, "upward imports:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from moe_runtime.server.app import create_app\n", "moe_runtime.server.app"),
    ("def f():\n    from moe_runtime import server\n", "moe_runtime.server"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import moe_runtime.server.cli\n",
     "moe_runtime.server.cli"),
    ("from ..server import cli\n", "moe_runtime.server"),
])
def test_the_parser_sees_every_form_of_import(source, expected):
    """A kernels module importing the server in each form is caught (the check can fail)."""
    [imp] = project_imports(PACKAGE / "kernels" / "imaginary.py", source)
    assert imp.target == expected
    assert stage_of(imp.target)[0] > stage_of(imp.importer)[0]
