"""Read an HF checkpoint's config.json into transformers' config object (local files only)."""
from __future__ import annotations

from pathlib import Path

from moe_runtime.config.multimodal_wrappers import text_model_config
from moe_runtime.errors import CheckpointError, UnsupportedArchitectureError


def load_hf_config(checkpoint_dir: str | Path):
    """The checkpoint's `PretrainedConfig`, with transformers' defaults filled in; a multimodal release's is its
    text model's (`multimodal_wrappers.py`)."""
    from transformers import AutoConfig

    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    if not config_path.exists():
        raise CheckpointError(f"{config_path} is missing: a checkpoint directory needs config.json")
    try:
        return text_model_config(AutoConfig.from_pretrained(str(checkpoint_dir), local_files_only=True))
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"{config_path}: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"{config_path} could not be read: {exc}") from exc


def architecture_of(hf_config) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise UnsupportedArchitectureError(
            f"config.json has no 'architectures' entry (model_type={getattr(hf_config, 'model_type', None)!r})"
        )
    return architectures[0]
