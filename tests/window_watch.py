"""Watching a windowed KV cache group's blocks: how many blocks of a sequence the group holds after each step,
the number a sliding or chunked layer must keep bounded however long the sequence grows."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def window_blocks_held(core) -> Iterator[list[int]]:
    """Yields a list that gets, at every scheduled step of every sequence, the most blocks any of its windowed
    groups holds (`core`: an `EngineCore`); the block manager is restored on exit."""
    manager = core.block_manager
    held: list[int] = []
    original = manager.schedule_tokens

    def watching(seq, num_tokens):
        original(seq, num_tokens)
        held.append(max(manager.window_blocks_held(seq)))

    manager.schedule_tokens = watching
    try:
        yield held
    finally:
        manager.schedule_tokens = original
