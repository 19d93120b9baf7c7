"""Engines a test module shares: one engine per key, built on first use (a test run that skips a layout never
pays its start-up) and shut down when the module is done."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Hashable, Iterator, TypeVar

from moe_runtime import LLM

E = TypeVar("E")


@contextmanager
def engine_pool(build: Callable[..., E]) -> Iterator[Callable[..., E]]:
    """Yields get(*key) -> build(*key), built once per key; every engine built is shut down on exit."""
    built: dict[Hashable, E] = {}

    def get(*key):
        if key not in built:
            built[key] = build(*key)
        return built[key]
    try:
        yield get
    finally:
        for engine in built.values():
            engine.shutdown()


@contextmanager
def lazy_engines(checkpoint: str | Path, layouts: dict[str, dict], **common) -> Iterator[Callable[[str], LLM]]:
    """Yields get(layout) -> the `LLM` of `checkpoint` with `common` and `layouts[layout]` options."""
    with engine_pool(lambda layout: LLM(str(checkpoint), **common, **layouts[layout])) as get:
        yield get


@contextmanager
def tiny_engine_pool(factory: Callable[[str], Path], layouts: dict[str, dict]) -> Iterator[Callable[[str, str], LLM]]:
    """Yields get(arch, layout) -> the fp32 CPU `LLM` of `factory(arch)` (a tiny checkpoint) with `layouts[layout]`."""
    with engine_pool(lambda arch, layout: LLM(str(factory(arch)), device="cpu", dtype="float32",
                                              **layouts[layout])) as get:
        yield get

