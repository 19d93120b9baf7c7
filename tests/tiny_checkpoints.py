"""Tiny random HF checkpoints for every supported architecture, and the transformers oracle.

Each builder writes a standard HF directory (config.json, safetensors, generation_config.json,
tokenizer files) from a `transformers` model with deterministic random weights
(`moe_runtime.weights.random_weights`: norm weights around 1 and biases nonzero too, so a loader that
drops a norm or a bias cannot pass by accident; DeepSeek-V3's e_score_correction_bias is nonzero
so grouped routing really depends on it).

`HFOracle` (and the one-shot `hf_greedy`, `hf_prefill_logits`) is the oracle the runtime is held against (fp32, one prompt
at a time, no padding).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from shared_builds import build_once
from tiny_archs import COMMON, TINY_ARCHS, TinyArch
from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights
from moe_runtime.demo.tokenizer_training import TokenizerSpec, save_tokenizer, train_tokenizer

TINY_VOCAB_SIZE = 512



def tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """A freshly trained small tokenizer (about 1-2 s); fixtures train it once per session."""
    return train_tokenizer(TokenizerSpec(vocab_size=vocab_size, model_max_length=COMMON["max_position_embeddings"]))


def tiny_config(arch: str, tokenizer, **overrides):
    """The transformers config of the tiny `arch` model, its vocab and special ids from `tokenizer`."""
    import transformers

    spec = _arch_spec(arch)
    kwargs = {**COMMON, **spec.config}
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    return getattr(transformers, spec.config_class)(**kwargs)


def build_model(config, seed: int = 0):
    """A transformers causal LM for `config`, fp32, eval mode, randomized with `seed`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed, RandomWeightScales(matrix_std=config.initializer_range))
    return model.eval()


def build_tiny_checkpoint(
    arch: str,
    path: str | Path,
    *,
    tokenizer=None,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides,
) -> Path:
    """Write a tiny random `arch` checkpoint (fp32 safetensors + tokenizer) into `path`.

    `tokenizer`: a tokenizer object or a saved tokenizer directory; None trains one (slower).
    `max_shard_size`: passed to `save_pretrained` to write a sharded checkpoint with an index.
    `overrides`: config arguments replacing the registry's (e.g. num_hidden_layers=4).
    """
    _arch_spec(arch)  # fail on a bad name before training a tokenizer
    path = Path(path)
    tokenizer_dir = Path(tokenizer) if isinstance(tokenizer, (str, Path)) else None
    tokenizer = _as_tokenizer(tokenizer)
    model = build_model(tiny_config(arch, tokenizer, **overrides), seed=seed)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), safe_serialization=True, **save_kwargs)
    if tokenizer_dir is None:
        save_tokenizer(tokenizer, path)
    else:  # copy the files as saved: re-saving a loaded tokenizer adds loader arguments to its config
        for file in sorted(tokenizer_dir.iterdir()):
            if file.is_file():
                shutil.copyfile(file, path / file.name)
    return path


def build_sharded_tiny_checkpoint(arch: str, path: str | Path, *, num_shards: int = 3, **kwargs) -> Path:
    """`build_tiny_checkpoint` split into about `num_shards` (>= 2) safetensors files with an index."""
    if num_shards < 2:
        raise ValueError(f"num_shards={num_shards}: a sharded checkpoint needs at least 2")
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        tokenizer = tiny_tokenizer()
    overrides = {k: v for k, v in kwargs.items() if k != "seed"}
    config = tiny_config(arch, _as_tokenizer(tokenizer), **overrides)
    total_bytes = _fp32_model_bytes(config)
    shard_bytes = max(1, math.ceil(total_bytes / num_shards))
    out = build_tiny_checkpoint(arch, path, tokenizer=tokenizer, max_shard_size=shard_bytes, **kwargs)
    if not (out / "model.safetensors.index.json").exists():
        raise RuntimeError(f"save_pretrained wrote no shard index into {out}")
    return out


class TinyCheckpointFactory:
    """Builds each (arch, options) checkpoint once under `root` (shared by the run's xdist workers) and hands back
    its path.

    `factory("deepseek_v3")`, `factory("llama", sharded=True)`, `factory("mixtral", num_hidden_layers=3)`.
    """

    def __init__(self, root: str | Path, tokenizer_dir: str | Path):
        self.root = Path(root)
        self.tokenizer_dir = Path(tokenizer_dir)
        self._built: dict[str, Path] = {}

    def __call__(self, arch: str, *, sharded: bool = False, seed: int = 0, **overrides) -> Path:
        key = repr((arch, sharded, seed, sorted(overrides.items())))
        if key not in self._built:   # once per run across pytest-xdist workers (shared_builds.py)
            builder = build_sharded_tiny_checkpoint if sharded else build_tiny_checkpoint
            self._built[key] = build_once(self.root, "checkpoint " + key, lambda path: builder(
                arch, path, tokenizer=self.tokenizer_dir, seed=seed, **overrides))
        return self._built[key]


class HFOracle:
    """A checkpoint in transformers (fp32, eval): the reference the runtime must match.

    Its answers are kept on disk across runs (`oracle_cache.py`; `cache=False` or $MOE_RUNTIME_TEST_ORACLE_CACHE=off:
    always computed), so the model is loaded only when an answer is missing. A caller that takes `model` may change
    it (dequantize it, patch a layer): from then on this oracle computes every answer and stores none. `config`
    reads the model's config without that.
    """

    def __init__(self, path: str | Path, cache: bool = True):
        from oracle_cache import OracleCache, cache_dir

        self.path = Path(path)
        root = cache_dir() if cache else None
        self._cache = OracleCache(root, self.path) if root is not None else None
        self._model = None

    def _loaded(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(
                str(self.path), dtype=torch.float32, local_files_only=True
            ).eval()
        return self._model

    @property
    def model(self):
        """The transformers model, for a caller that may change it: this oracle's cache is off from now on."""
        self._cache = None
        return self._loaded()

    @property
    def config(self):
        return self._loaded().config

    def greedy(self, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation (new tokens only) of each prompt, eos ignored.

        Each prompt runs alone (no padding) and no stop token is set, so every result has exactly
        `max_new_tokens` ids: the exact oracle for a runtime run with ignore_eos.
        """
        for index, ids in enumerate(prompts_token_ids):
            if len(ids) == 0:
                raise ValueError(f"prompts_token_ids[{index}] is empty")
        results: list[list[int]] = []
        for ids in prompts_token_ids:
            tokens = self._cache.get_greedy(list(ids), max_new_tokens) if self._cache is not None else None
            if tokens is None:
                tokens = self._generate(list(ids), max_new_tokens)
                if self._cache is not None:
                    self._cache.put_greedy(list(ids), max_new_tokens, tokens)
            results.append(tokens)
        return results

    def _generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        from transformers import GenerationConfig

        model = self._loaded()
        generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=model.config.pad_token_id,
            bos_token_id=model.config.bos_token_id,
        )
        with torch.no_grad():
            input_ids = torch.tensor([ids], dtype=torch.long)  # [1, T]
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
            )  # [1, T + max_new_tokens]
        new_tokens = out[0, input_ids.shape[1] :].tolist()
        if len(new_tokens) != max_new_tokens:
            raise RuntimeError(f"transformers generated {len(new_tokens)} tokens, wanted {max_new_tokens}")
        return new_tokens

    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits `[T, V]` at every position of one prompt, one forward without cache."""
        if len(token_ids) == 0:
            raise ValueError("token_ids is empty")
        ids = list(token_ids)
        logits = self._cache.get_logits(ids) if self._cache is not None else None
        if logits is None:
            with torch.no_grad():
                input_ids = torch.tensor([ids], dtype=torch.long)  # [1, T]
                out = self._loaded()(input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
            logits = out[0].float()  # [T, V]
            if self._cache is not None:
                self._cache.put_logits(ids, logits)
        return logits


class GreedyOracle:
    """transformers' greedy continuations of tiny checkpoints, each (arch, prompt) asked of `HFOracle` once per
    session (which keeps them on disk across runs).

    Greedy decoding with eos ignored is deterministic, so the first n tokens of a longer continuation
    are the n-token continuation: a test asking for fewer tokens is answered from a longer run.
    """

    def __init__(self, factory: "TinyCheckpointFactory"):
        self._factory = factory
        self._tokens: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def __call__(self, arch: str, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        keys = [(arch, tuple(ids)) for ids in prompts_token_ids]
        missing = list(dict.fromkeys(k for k in keys if len(self._tokens.get(k, ())) < max_new_tokens))
        if missing:
            found = HFOracle(self._factory(arch)).greedy([list(ids) for _, ids in missing], max_new_tokens)
            self._tokens.update(zip(missing, found))
        return [self._tokens[key][:max_new_tokens] for key in keys]


def hf_greedy(path: str | Path, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation (new tokens only) of each prompt: see `HFOracle.greedy`."""
    return HFOracle(path).greedy(prompts_token_ids, max_new_tokens)


def hf_prefill_logits(path: str | Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits `[T, V]` for every position of one prompt."""
    return HFOracle(path).prefill_logits(token_ids)


def _arch_spec(arch: str) -> TinyArch:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_ARCHS)}")
    return TINY_ARCHS[arch]


def _as_tokenizer(tokenizer):
    if tokenizer is None:
        return tiny_tokenizer()
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def _fp32_model_bytes(config) -> int:
    """Bytes of the model's fp32 weights, built on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return sum(t.numel() * 4 for t in model.state_dict().values())
