"""The embedded demo model: a small DeepSeek-V3-style MoE checkpoint built locally, no download.

`ensure_demo_model()` builds it once into the cache (`$MOE_RUNTIME_CACHE/demo-v2`, else
`~/.cache/moe_runtime/demo-v2`) and returns its path; `python -m moe_runtime.demo.demo_model [PATH]` does
the same, or writes it to PATH. The weights are random (seeded), so its text means nothing, but
it exercises everything a real DeepSeek-V3 does: MLA with q_lora, a dense first layer, sigmoid
grouped top-k routing with a nonzero correction bias, routed scaling and a shared expert.

Stored as fp32 safetensors in standard HF layout (config.json, model.safetensors,
generation_config.json, tokenizer files). A build happens in a temporary sibling directory that
is renamed into place, so concurrent builders never leave a half-written model behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moe_runtime.demo.tokenizer_training import TokenizerSpec, chat_stop_token_ids, save_tokenizer, train_tokenizer

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-v2"  # bump when the spec below or the files written change, so stale caches are not reused
# demo-v2: a tokenizer_config.json every accepted transformers loads, a chat template with tools
CACHE_ENV = "MOE_RUNTIME_CACHE"
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape of the demo model (DeepseekV3ForCausalLM) and its tokenizer."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    intermediate_size: int = 512  # dense layers
    moe_intermediate_size: int = 128
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    num_attention_heads: int = 8
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    max_position_embeddings: int = 2048
    initializer_range: float = 0.08  # weight std; spreads logits so greedy text is not one token
    seed: int = 0


def default_cache_root() -> Path:
    """`$MOE_RUNTIME_CACHE`, else `~/.cache/moe_runtime`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moe_runtime"


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the demo checkpoint under `cache_dir` (default: `default_cache_root()`), built if absent."""
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return build_demo_model(target / DEMO_NAME)


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def build_demo_model(path: str | Path, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Write the demo checkpoint to `path` unless a complete one is already there; returns `path`."""
    path = Path(path).expanduser()
    if is_complete(path):
        logger.info("demo model already at %s", path)
        return path
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not a complete demo model (missing one of {REQUIRED_FILES})")
    path.parent.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        _write_demo_model(staging, spec)
        _make_readable(staging)
        _move_into_place(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("demo model ready at %s (%.1f s)", path, time.monotonic() - start)
    return path


def demo_tokenizer_spec(spec: DemoModelSpec = DemoModelSpec()) -> TokenizerSpec:
    """What the demo's tokenizer is trained from."""
    return TokenizerSpec(vocab_size=spec.vocab_size, model_max_length=spec.max_position_embeddings)


def demo_config(tokenizer, spec: DemoModelSpec = DemoModelSpec()):
    """The `DeepseekV3Config` of the demo model; special token ids come from `tokenizer`."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        n_shared_experts=spec.n_shared_experts,
        n_routed_experts=spec.n_routed_experts,
        routed_scaling_factor=spec.routed_scaling_factor,
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=spec.q_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        num_experts_per_tok=spec.num_experts_per_tok,
        first_k_dense_replace=spec.first_k_dense_replace,
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def _write_demo_model(directory: Path, spec: DemoModelSpec) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights

    logger.info("demo model 1/3: training the tokenizer (vocab %d)", spec.vocab_size)
    tokenizer = train_tokenizer(demo_tokenizer_spec(spec))
    logger.info("demo model 2/3: building DeepseekV3ForCausalLM with seeded random weights")
    config = demo_config(tokenizer, spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, spec.seed, RandomWeightScales(matrix_std=spec.initializer_range))
    model.generation_config.eos_token_id = chat_stop_token_ids(tokenizer)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("demo model 3/3: writing %.1fM fp32 parameters to %s", n_params / 1e6, directory)
    model.save_pretrained(str(directory), safe_serialization=True)
    save_tokenizer(tokenizer, directory)


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; a cache should read like a normal download."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _move_into_place(staging: Path, path: Path) -> None:
    """Rename `staging` to `path` atomically; if another builder got there first, keep theirs."""
    try:
        if path.is_dir():
            path.rmdir()  # an empty placeholder; a finished model (another builder's) stays
    except OSError:
        pass
    try:
        os.rename(staging, path)
    except OSError:
        if not is_complete(path):
            raise
        logger.info("another process finished %s first; using its copy", path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_runtime.demo.demo_model",
        description="Build the embedded demo MoE checkpoint (DeepSeek-V3 style, random weights).",
    )
    parser.add_argument(
        "path",
        nargs="?",
        type=Path,
        help=f"directory to write; default: the cache (${CACHE_ENV} or ~/.cache/moe_runtime)/{DEMO_NAME}",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = ensure_demo_model() if args.path is None else build_demo_model(args.path)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
