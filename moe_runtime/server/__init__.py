"""The OpenAI-compatible HTTP service: `build_app(async_engine, served_model_name, ...)`.

`build_app` and `Mount` load on first use: `moe-serve --help` (moe_runtime.server.cli) must not wait for fastapi and torch.
"""
from __future__ import annotations

import importlib


__all__ = ["Mount", "build_app"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("moe_runtime.server.app"), name)
    raise AttributeError(f"module 'moe_runtime.server' has no attribute {name!r}")
