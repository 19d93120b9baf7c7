"""Built once per test run, whatever the number of pytest-xdist workers: tiny checkpoints, the tokenizer, the demo.

Each worker of `pytest -n 2` is a session of its own, and session fixtures would build everything twice. The
workers' temp dirs share a parent (`pytest-N/popen-gwK`), so a build goes there, under a file lock, and the
second worker finds it done (`.complete`). Without xdist the session's own temp dir serves.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable

COMPLETE = ".complete"


def shared_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-builds"
    root.mkdir(exist_ok=True)
    return root


def build_once(root: Path, key: str, build: Callable[[Path], object]) -> Path:
    """`root/<digest of key>`, made by `build(path)` the first time any worker asks for `key`."""
    path = root / hashlib.sha256(key.encode()).hexdigest()[:16]
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / COMPLETE).exists():
            if path.exists():   # a worker died mid-build
                shutil.rmtree(path)
            path.mkdir()
            build(path)
            (path / COMPLETE).touch()
    return path
