"""Read an HF checkpoint's config.json into transformers' config object (local files only, no remote code).

Some releases name a model type only their remote code defines while their weights are a backbone transformers
knows: Kimi K2 (`model_type: kimi_k2`, `auto_map` to its own files) is DeepSeek-V3. `REMOTE_CODE_BACKBONES`
reads those as the backbone's config, without running the remote code; `REMOTE_CODE_WRAPPERS` are multimodal
wrappers of such a text model (Kimi K2.5, `model_type: kimi_k25`), read as their text model's config
(multimodal_wrappers.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from moe_runtime.config.multimodal_wrappers import text_model_config
from moe_runtime.errors import CheckpointError, UnsupportedArchitectureError


REMOTE_CODE_BACKBONES = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}   # model_type -> (backbone, class)
REMOTE_CODE_WRAPPERS = frozenset({"kimi_k25"})   # a wrapper's model_type; its text_config's is a backbone's


def backbone_config(config_path: Path):
    """A remote-code model type's config as its backbone's (None: not one of `REMOTE_CODE_BACKBONES`)."""
    try:
        data = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("model_type") in REMOTE_CODE_WRAPPERS:
        wrapper = _remote_code_wrapper(data, config_path)
        text = text_model_config(wrapper)
        if text is wrapper:
            raise UnsupportedArchitectureError(f"{config_path}: model_type {data['model_type']!r} with architectures "
                                               f"{data.get('architectures')!r}: not a multimodal wrapper this runtime "
                                               "reads (multimodal_wrappers.WRAPPERS)")
        return text
    backbone = REMOTE_CODE_BACKBONES.get(data.get("model_type")) if isinstance(data, dict) else None
    if backbone is None:
        return None
    return _as_backbone(data, *backbone)


def _as_backbone(data: dict, model_type: str, architecture: str):
    from transformers import CONFIG_MAPPING

    data = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
    config = CONFIG_MAPPING[model_type].from_dict(data)
    if not config.architectures or config.architectures[0] != architecture:
        config.architectures = [architecture]
    return config


def _remote_code_wrapper(data: dict, config_path: Path) -> SimpleNamespace:
    """A remote-code wrapper's config (what `text_model_config` reads of it): its top-level fields, and its text
    model's config as the backbone's (Kimi K2.5: `kimi_k2`, or `deepseek_v3` as some re-releases write it); the
    vision config is not read."""
    from transformers import CONFIG_MAPPING

    text = data.get("text_config")
    model_type = text.get("model_type") if isinstance(text, dict) else None
    backbone = REMOTE_CODE_BACKBONES.get(model_type)
    if backbone is None and model_type in CONFIG_MAPPING and text.get("architectures"):
        backbone = (model_type, text["architectures"][0])
    if backbone is None:
        raise UnsupportedArchitectureError(
            f"{config_path}: model_type {data.get('model_type')!r} needs a text_config of a model type transformers "
            f"or {sorted(REMOTE_CODE_BACKBONES)} name, with its architectures; got model_type {model_type!r}")
    outer = {k: v for k, v in data.items() if k not in ("text_config", "vision_config", "auto_map")}
    return SimpleNamespace(**outer, text_config=_as_backbone(text, *backbone))


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
    backbone = backbone_config(config_path)
    if backbone is not None:
        return backbone
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
