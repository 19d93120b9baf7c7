"""The tiny checkpoints the model parts build: one factory per part, under the run's work directory."""
from __future__ import annotations

from pathlib import Path

from moe_runtime.demo.tokenizer_training import save_tokenizer
from tiny_checkpoints import TinyCheckpointFactory, tiny_tokenizer


def tiny_factory(work_dir: str | Path) -> TinyCheckpointFactory:
    """`factory(arch, **config_overrides) -> Path` over the tests' tiny tokenizer, saved once into `work_dir`."""
    work = Path(work_dir)
    return TinyCheckpointFactory(work / "tiny_checkpoints", save_tokenizer(tiny_tokenizer(), work / "tiny_tokenizer"))
