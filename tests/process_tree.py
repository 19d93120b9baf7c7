"""Finding a launcher's worker-rank processes through /proc (ranks fork from a fork server below it)."""
from __future__ import annotations

import os


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def children_of() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[0] != "Z":
                tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> set[int]:
    tree, found, todo = children_of(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def rank_pids(launcher_pid: int) -> list[int]:
    """The worker ranks: the children of the fork server the launcher started."""
    tree = children_of()
    ranks = []
    for child in tree.get(launcher_pid, []):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                is_fork_server = b"forkserver" in cmdline.read()
        except OSError:
            continue
        if is_fork_server:
            ranks.extend(tree.get(child, []))
    return sorted(ranks)
