"""The engine's request operations exist once: `Front` answers `abort`, `health` and `stats` for every caller
(`LLM.engine`, `AsyncEngine.front`, the server's routes) over either transport, and the transports are the one
`EngineCoreClient` Protocol with one implementation each (`InProcessClient`, `RankClient`).

Read from the source (no engine is built): a method named `abort`, `health` or `stats` on any other class of
`moe_runtime` fails here with its file and line, unless it is listed below with what else it answers. A layer
that wraps the front's operation again, or a component whose own operation (dropping a sequence, forgetting a
grammar, cancelling a pull) takes the name, is what this keeps out.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from moe_runtime.front.async_engine import AsyncEngine
from moe_runtime.front.core_client import EngineCoreClient
from moe_runtime.front.front import Front
from moe_runtime.front.inprocess_client import InProcessClient
from moe_runtime.front.llm import LLM
from moe_runtime.front.rank_client import RankClient

PACKAGE = Path(__file__).resolve().parent.parent / "moe_runtime"
REQUEST_OPERATIONS = ("abort", "health", "stats")
THE_ONE = "front/front.py:Front"
OTHER_SERVICES = {   # the same word for something that is not the engine's request operation
    "server/pd_router/backends.py:BackendPool.health": "the P/D router's view of its backend servers",
    "sampling/host_reads.py:DecodeHostReads.stats": "a step's host-read counters, folded into WorkerStats",
    "speculative/speculation.py:Speculation.stats": "the drafter's counters, folded into WorkerStats",
}


def defined_operations() -> dict[str, int]:
    """'file:Class.method' -> line, for every class method of moe_runtime named like a request operation."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in REQUEST_OPERATIONS:
                    found[f"{path.relative_to(PACKAGE).as_posix()}:{node.name}.{item.name}"] = item.lineno
    return found


def test_abort_health_and_stats_are_defined_once_in_the_front():
    found = defined_operations()
    assert {f"{THE_ONE}.{name}" for name in REQUEST_OPERATIONS} <= set(found)
    others = {where: line for where, line in found.items()
              if not where.startswith(f"{THE_ONE}.") and where not in OTHER_SERVICES}
    assert not others, ("a second definition of a request operation (Front has the one; a component's own operation "
                        f"takes a name that says what it does): {others}")
    assert set(OTHER_SERVICES) <= set(found), "an allowed exception is gone: take it off OTHER_SERVICES"


def test_the_layers_above_the_front_expose_it_instead_of_wrapping_it():
    for layer in (AsyncEngine, LLM):
        wrapped = [name for name in REQUEST_OPERATIONS if hasattr(layer, name)]
        assert not wrapped, f"{layer.__name__} wraps {wrapped}: callers use its front"
    assert "front" in inspect.signature(AsyncEngine.__init__).parameters
    assert inspect.signature(LLM.engine.fget).return_annotation in (Front, "Front")


def test_one_core_client_protocol_with_one_implementation_per_transport():
    declared = {name for name, value in vars(EngineCoreClient).items()
                if callable(value) and not name.startswith("_")}
    assert {"send", "receive", "pending", "attach", "detach", "reform", "shutdown"} <= declared
    for transport in (InProcessClient, RankClient):
        missing = sorted(name for name in declared if name not in vars(transport))
        assert not missing, f"{transport.__name__} does not implement {missing} itself"
        assert not [name for name in REQUEST_OPERATIONS if hasattr(transport, name)], \
            f"{transport.__name__}: the request operations are the front's, sent as commands (AbortRequest)"
