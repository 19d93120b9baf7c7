"""The checkpoint's tokenizer and end-of-sequence ids, from its files (local only, no remote code)."""
from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def load_tokenizer(checkpoint_dir: Path):
    """The checkpoint's tokenizer (local files only), or None when it ships none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        needs = " (its tiktoken.model loads only through the release's remote code, which is not run here: add a " \
                "tokenizer.json converted from it)" if (checkpoint_dir / "tiktoken.model").exists() else ""
        logger.warning("no tokenizer in %s%s (%s): only token-id prompts will work", checkpoint_dir, needs, exc)
        return None


def eos_token_ids(checkpoint_dir: Path, hf_config, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        found = GenerationConfig.from_pretrained(str(checkpoint_dir), local_files_only=True).eos_token_id
    except OSError:
        found = getattr(hf_config, "eos_token_id", None)
    if found is None and tokenizer is not None:
        found = tokenizer.eos_token_id
    if isinstance(found, int):
        ids.add(found)
    elif found:
        ids.update(int(i) for i in found)
    return ids
