"""The error of a setting the engine cannot run with (its own file: every settings part raises it)."""
from __future__ import annotations

from moe_runtime.errors import InvalidRequestError


class EngineConfigError(InvalidRequestError):
    """A setting (or a combination of settings) the engine cannot run with; the message names the flag."""
