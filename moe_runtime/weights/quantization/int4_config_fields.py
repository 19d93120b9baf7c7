"""The int4 fields of config.json's `quantization_config` that AWQ and GPTQ share, read or refused by name.

Torch-free: the planner reads them too (moe_runtime/planner/int4_experts.py), to price a release's experts at the
size the engine keeps them.
"""
from __future__ import annotations

from moe_runtime.errors import CheckpointError

CHANNEL_GROUP_SIZES = (-1, None)   # one group a row
DEFAULT_GROUP_SIZE = 128


def int4_bits(quant: dict, method: str, where: str) -> None:
    """Refuse `bits` other than the integer 4 (a string "4" is refused too: no writer stores one)."""
    bits = quant.get("bits", 4)
    if isinstance(bits, bool) or bits != 4:
        raise CheckpointError(f"{where}: {method} quantization_config.bits {bits!r}: only 4-bit {method} is read")


def int4_group_size(quant: dict, method: str, where: str) -> int | None:
    """quantization_config.group_size: a positive integer, or -1 / null for one group a row (None)."""
    size = quant.get("group_size", DEFAULT_GROUP_SIZE)
    if size in CHANNEL_GROUP_SIZES and not isinstance(size, bool):
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise CheckpointError(f"{where}: {method} quantization_config.group_size {size!r}: must be a positive "
                              f"integer, or -1 for one group a row")
    return size
