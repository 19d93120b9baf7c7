"""What a transformers module's forward takes, read from its signature (modules are found by what they accept)."""
from __future__ import annotations

import inspect

from torch import nn


def takes_any_argument(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether `module.forward` has a parameter called one of `names` (False where it has no readable signature)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in names)
