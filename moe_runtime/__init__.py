"""moe-runtime: a Mixture-of-Experts expert-parallel inference runtime.

`LLM`, `RequestOutput` and `SamplingParams` are loaded on first use, so that importing one of the
engine's leaf modules (e.g. `moe_runtime.errors` from `attention_dp`) does not pull in the whole
engine, and the packages can import each other's leaves in any order.
"""
from __future__ import annotations

import importlib

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_EXPORTS = {"LLM": "moe_runtime.front.llm", "RequestOutput": "moe_runtime.records.outputs",
            "SamplingParams": "moe_runtime.sampling.params"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moe_runtime' has no attribute {name!r}")
