"""transformers' answers for tiny checkpoints (greedy tokens, prefill logits), kept on disk across test runs.

transformers' `generate` on CPU is a large share of the suite's time, and its answer for a given checkpoint, prompt
and length never changes. An entry's key is a digest of everything the answer depends on: the checkpoint's files
(their bytes, so a rebuilt or changed checkpoint is a new key), the request (prompt ids, length), and the versions
of transformers and torch. Entries carry their key and a digest of their payload; one that does not read back whole
and matching (truncated, altered, another key's) is computed again and replaced, never trusted.

Where: $MOE_RUNTIME_TEST_ORACLE_CACHE, else $XDG_CACHE_HOME (~/.cache)/moe-runtime-tests/oracle; `off` (or 0)
computes everything, as before. Entries are written whole (a temporary file renamed), so xdist workers and
concurrent runs can share the directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

CACHE_ENV = "MOE_RUNTIME_TEST_ORACLE_CACHE"
FORMAT = "moe-runtime oracle cache 1: AutoModelForCausalLM fp32 eval, one prompt at a time, eos ignored"
IGNORED_FILES = {".complete"}   # shared_builds' marker, written after the checkpoint is whole


def cache_dir() -> Path | None:
    """The cache's directory, or None when it is off."""
    configured = os.environ.get(CACHE_ENV, "").strip()
    if configured.lower() in ("off", "0", "false", "no"):
        return None
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe-runtime-tests" / "oracle"


_digests: dict[tuple, str] = {}


def checkpoint_digest(path: str | Path) -> str:
    """sha256 over the checkpoint's files (relative names and bytes); read again when any file's inode, size,
    mtime or ctime changes."""
    root = Path(path).resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in IGNORED_FILES)
    if not files:
        raise FileNotFoundError(f"no checkpoint files under {root}")
    stats = [p.stat() for p in files]
    signature = (str(root), tuple((str(p), s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                                  for p, s in zip(files, stats)))
    if signature not in _digests:
        digest = hashlib.sha256()
        for file in files:
            name = file.relative_to(root).as_posix().encode()
            digest.update(len(name).to_bytes(8, "little") + name)
            data = file.read_bytes()
            digest.update(len(data).to_bytes(8, "little") + data)
        _digests[signature] = digest.hexdigest()
    return _digests[signature]


def entry_key(checkpoint: str, request: dict) -> str:
    import transformers

    described = {"format": FORMAT, "transformers": transformers.__version__, "torch": torch.__version__,
                 "checkpoint": checkpoint, **request}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


class OracleCache:
    """Greedy tokens and prefill logits of one checkpoint, read from and written to `root`."""

    def __init__(self, root: Path, checkpoint: str | Path):
        self.root = root
        self.checkpoint = checkpoint_digest(checkpoint)

    def _path(self, key: str, suffix: str) -> Path:
        return self.root / key[:2] / f"{key}{suffix}"

    # ---- greedy tokens: JSON {"key", "tokens", "sha256"}
    def get_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int] | None:
        key = entry_key(self.checkpoint, {"op": "greedy", "prompt": list(prompt), "max_new_tokens": max_new_tokens})
        try:
            entry = json.loads(self._path(key, ".json").read_text())
            tokens = entry["tokens"]
            valid = (entry["key"] == key and entry["sha256"] == _tokens_digest(tokens) and len(tokens) == max_new_tokens
                     and all(type(t) is int for t in tokens))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return tokens if valid else None

    def put_greedy(self, prompt: list[int], max_new_tokens: int, tokens: list[int]) -> None:
        key = entry_key(self.checkpoint, {"op": "greedy", "prompt": list(prompt), "max_new_tokens": max_new_tokens})
        entry = {"key": key, "tokens": list(tokens), "sha256": _tokens_digest(tokens)}
        _write_whole(self._path(key, ".json"), json.dumps(entry).encode())

    # ---- prefill logits: safetensors with the key and the tensor's digest in its metadata
    def get_logits(self, token_ids: list[int]) -> torch.Tensor | None:
        from safetensors import safe_open

        key = entry_key(self.checkpoint, {"op": "prefill_logits", "token_ids": list(token_ids)})
        try:
            with safe_open(str(self._path(key, ".safetensors")), framework="pt") as opened:
                metadata = opened.metadata() or {}
                logits = opened.get_tensor("logits")
        except Exception:  # noqa: BLE001 - absent, truncated or not safetensors at all: computed again
            return None
        valid = (metadata.get("key") == key and logits.dtype == torch.float32 and logits.dim() == 2
                 and logits.shape[0] == len(token_ids) and metadata.get("sha256") == _tensor_digest(logits))
        return logits if valid else None

    def put_logits(self, token_ids: list[int], logits: torch.Tensor) -> None:
        from safetensors.torch import save

        key = entry_key(self.checkpoint, {"op": "prefill_logits", "token_ids": list(token_ids)})
        logits = logits.detach().to(torch.float32).contiguous()
        data = save({"logits": logits}, metadata={"key": key, "sha256": _tensor_digest(logits)})
        _write_whole(self._path(key, ".safetensors"), data)


def _tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()


def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def _write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, all or nothing (readers never see a partial file). Failing to write only loses the entry."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass
