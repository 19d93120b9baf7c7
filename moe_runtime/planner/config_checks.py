"""The planner's input, read and checked once: `moe-serve plan --model X` trusts nothing in X.

`read_config` opens only a regular file (a symlink to /dev/zero or a FIFO is refused before anything is read,
and the descriptor is opened non-blocking and checked with fstat, so nothing can be swapped in between) of at
most `MAX_CONFIG_BYTES`, decodes it as strict UTF-8 and parses JSON without NaN/Infinity, refusing nesting
past the parser's depth and integers past Python's digit limit. `check_config` then holds every size field
the planner reads to a positive integer in a sane range (`SIZE_FIELDS`: a 1e12-layer model would otherwise
be planned for minutes), top-k to the expert count, and the dtype to a known one. Every refusal is a
`ConfigError` naming the field and the reason, which `moe-serve plan` prints as one line (exit 2).
"""
from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_runtime.errors import MoERuntimeError

MAX_CONFIG_BYTES = 4 * 2**20      # real config.json files are a few KB (a multimodal one tens of KB)
CHECKPOINT_DTYPES = frozenset({"float32", "float", "bfloat16", "float16", "half", "float8_e4m3fn", "float8_e5m2"})


class ConfigError(MoERuntimeError):
    """A config the planner refuses: `field: why` (field is "config.json" for the file as a whole)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


@dataclass(frozen=True)
class SizeField:
    """A config field the planner computes with: an integer in [lo, hi] when present (None: absent)."""

    name: str
    lo: int
    hi: int


SIZE_FIELDS = tuple(SizeField(*spec) for spec in (
    ("num_hidden_layers", 1, 4096), ("hidden_size", 1, 2**20), ("num_attention_heads", 1, 2**14),
    ("num_key_value_heads", 1, 2**14), ("head_dim", 1, 2**16), ("vocab_size", 1, 2**24),
    ("max_position_embeddings", 1, 2**30), ("intermediate_size", 0, 2**24), ("moe_intermediate_size", 0, 2**24),
    ("shared_expert_intermediate_size", 0, 2**24), ("intermediate_size_mlp", 0, 2**24),
    ("num_experts", 0, 2**16), ("n_routed_experts", 0, 2**16), ("num_local_experts", 0, 2**16),
    ("num_experts_per_tok", 1, 2**16), ("n_shared_experts", 0, 2**10), ("first_k_dense_replace", 0, 4096),
    ("decoder_sparse_step", 1, 4096), ("interleave_moe_layer_step", 1, 4096),
    ("kv_lora_rank", 1, 2**16), ("q_lora_rank", 1, 2**16), ("qk_rope_head_dim", 0, 2**16),
    ("qk_nope_head_dim", 0, 2**16), ("v_head_dim", 1, 2**16), ("o_lora_rank", 1, 2**16), ("o_groups", 1, 2**14),
    ("sliding_window", 0, 2**30), ("attention_chunk_size", 1, 2**30),
    ("index_topk", 1, 2**30), ("index_head_dim", 1, 2**16), ("index_n_heads", 1, 2**14),
    ("linear_conv_kernel_dim", 1, 2**10), ("linear_key_head_dim", 1, 2**16), ("linear_value_head_dim", 1, 2**16),
    ("linear_num_key_heads", 1, 2**14), ("linear_num_value_heads", 1, 2**14),
))
EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


def read_config(model: str | Path) -> dict:
    """config.json of a checkpoint directory, or the file itself, as a JSON object."""
    path = Path(model)
    try:
        path = path / "config.json" if path.is_dir() else path
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(str(path), "is not a regular file (a device, FIFO or directory): give config.json")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(str(path), f"is {info.st_size:,} bytes, more than a config ({MAX_CONFIG_BYTES:,})")
        raw = file.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:   # grew while being read
        raise ConfigError(str(path), f"is more than {MAX_CONFIG_BYTES:,} bytes")
    return parse_config(raw)


def parse_config(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("config.json", f"is not UTF-8 text (byte {exc.start})") from None
    try:
        config = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ConfigError("config.json", "is nested too deeply to be a model config") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("config.json", f"is not JSON ({exc.msg}, line {exc.lineno})") from None
    except NonFiniteConstant as exc:
        raise ConfigError("config.json", str(exc)) from None
    except ValueError:   # an integer of more digits than Python converts
        raise ConfigError("config.json", f"holds an integer of more than {sys.get_int_max_str_digits()} "
                                         "digits") from None
    if not isinstance(config, dict):
        raise ConfigError("config.json", f"must be a JSON object, not {type(config).__name__}")
    return config


class NonFiniteConstant(ValueError):
    """JSON's non-standard NaN / Infinity / -Infinity, which no size can be."""


def _refuse_constant(name: str):
    raise NonFiniteConstant(f"holds {name}, which is not a size")


def check_config(config: dict, moe: bool) -> None:
    """The fields the planner reads (the decoder's: a multimodal config's text_config), each in range."""
    for spec in SIZE_FIELDS:
        value = config.get(spec.name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(spec.name, f"{_shown(value)} is not an integer")
        if not spec.lo <= value <= spec.hi:
            raise ConfigError(spec.name, f"{_shown(value)} is outside [{spec.lo}, {spec.hi}]")
    for required in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if config.get(required) is None:
            raise ConfigError(required, "is missing")
    if moe:
        experts = next((config[name] for name in EXPERT_COUNT_FIELDS if config.get(name)), None)
        if experts is None:
            raise ConfigError("num_experts", "is missing or 0 on a mixture-of-experts architecture")
        top_k = config.get("num_experts_per_tok")
        if top_k is not None and top_k > experts:
            raise ConfigError("num_experts_per_tok", f"{top_k} is more than the {experts} routed experts")
    for name in ("torch_dtype", "dtype"):
        value = config.get(name)
        if value is not None and value not in CHECKPOINT_DTYPES:
            raise ConfigError(name, f"{_shown(value)} is not a dtype ({', '.join(sorted(CHECKPOINT_DTYPES))})")
    for name in ("layer_types", "mlp_only_layers", "mlp_layer_types", "moe_layers", "indexer_types"):
        value = config.get(name)
        if value is not None and (not isinstance(value, list) or len(value) > 4096):
            raise ConfigError(name, "must be a list with an entry per layer")


def text_config_of(config: dict) -> dict | None:
    """A multimodal config's decoder fields (None: the config is the decoder's)."""
    if "text_config" not in config:
        return None
    text = config["text_config"]
    if not isinstance(text, dict) or not text:
        raise ConfigError("text_config", "must be a non-empty JSON object (the decoder's config)")
    return text


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
