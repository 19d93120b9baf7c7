"""Engines a test module shares: one `LLM` per named layout, built on first use (a test run that skips a layout
never pays its start-up) and shut down when the module is done."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from moe_runtime import LLM


@contextmanager
def lazy_engines(checkpoint: str | Path, layouts: dict[str, dict], **common) -> Iterator[Callable[[str], LLM]]:
    """Yields get(layout) -> the `LLM` of `checkpoint` with `common` and `layouts[layout]` options."""
    built: dict[str, LLM] = {}

    def get(layout: str) -> LLM:
        if layout not in built:
            built[layout] = LLM(str(checkpoint), **common, **layouts[layout])
        return built[layout]
    try:
        yield get
    finally:
        for llm in built.values():
            llm.shutdown()
