"""What one check returns, and the `Part` protocol every gpu_check part module implements.

A part module defines `build_part(mode: RunMode) -> Part`. The child process (`gpu_check_part.py`)
asks it for its check names once, then runs them one by one; a part keeps whatever setup its
checks share (a tokenizer, checkpoints, a started server) on itself, built on first use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Outcome:
    status: str                                   # passed | failed | skipped (errors are raised)
    details: dict = field(default_factory=dict)
    error: str | None = None


def passed(**details) -> Outcome:
    return Outcome("passed", details)


def failed(reason: str, **details) -> Outcome:
    return Outcome("failed", details, reason)


def skipped(reason: str, **details) -> Outcome:
    return Outcome("skipped", details, reason)


def judged(problems: list[str], **details) -> Outcome:
    """Passed when `problems` is empty, else failed with all of them."""
    return passed(**details) if not problems else failed("; ".join(problems), **details)


class Part(Protocol):
    def check_names(self) -> list[str]:
        """Every check this part will run, in order (unique names)."""

    def run(self, name: str) -> Outcome:
        """Run one check; raising records an `error` for it and the part goes on with the next."""

    def close(self) -> None:
        """Release what the checks shared (servers, GPU memory); called once at the end."""
