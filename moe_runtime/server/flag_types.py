"""argparse `type=` converters for `moe-serve` flags: sizes, counts and ports with usage errors that say why."""
from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '512M', '2G', '1.5GiB', '268435456' (binary units: 1K = 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a number with K/M/G/T, e.g. 512M, 2G")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def tcp_port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535)")
    return value


def json_object(text: str) -> dict:
    """A JSON object ('{"method": "ngram", ...}'), as vLLM's --speculative-config takes it."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


class AppendToTuple(argparse.Action):
    """A repeatable flag whose values collect in a tuple (its config field's type; argparse's "append" makes a
    list and would append to the default itself)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))
