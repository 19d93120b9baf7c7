"""Attention layers transformers computes with its own cache and mask, run per sequence on our paged KV cache
(moe_runtime/models/transformers_backend/own_cache_attention.py): a DeepSeek-Sparse-Attention indexer model
(HY-V4: indexer keys in the paged entry, shared top-k layers handed the previous layer's picks) and Inkling (a
relative position bias over the cache's key positions, short convolutions in our state slots), Doge (a dynamic
mask from the cached values, its top-k window shorter than the prompts), and MiniMax's
lightning attention (a recurrent state continued across prefill chunks and restored from prefix snapshots), against
transformers' greedy tokens with 16-token prefill chunks, a prefix-cache hit, several sequences in one step, and
--ep 2 --dp-attn 2. The sweep's tiny checkpoints and prompts (arch_sweep_cases.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from arch_sweep_cases import ENGINE_OPTIONS, NEW_TOKENS, PROMPTS, SHARED_PREFIX, build_sweep_checkpoint, oracle_tokens
from engine_helpers import greedy
from lazy_engines import engine_pool
from shared_builds import build_once, shared_root
from moe_runtime import LLM
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.models.transformers_backend import TransformersCausalLM

LAYOUTS = {"chunked": {}, "ep2_dp2": dict(ep=2, dp_attn=2)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread while the module runs (as the sweep's tests): tiny models, a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _doge_with_a_short_window(path: Path, tokenizer_dir: Path) -> Path:
    """The sweep's Doge with keep_window_size 12, below the prompts: its dynamic mask keeps a top-k of the keys."""
    from arch_sweep_configs import tiny_config
    from tiny_checkpoints import build_model
    from transformers import AutoTokenizer

    config = tiny_config("doge", AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    config.keep_window_size = 12
    build_model(config).save_pretrained(str(path), safe_serialization=True)
    for file in sorted(tokenizer_dir.iterdir()):
        if file.is_file():
            shutil.copyfile(file, path / file.name)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    """`checkpoint(model_type) -> Path`: the sweep's tiny checkpoint (or "doge_window"), built once per run."""
    def get(model_type: str):
        if model_type == "doge_window":
            return build_once(shared_root(tmp_path_factory), "own-cache doge window",
                              lambda path: _doge_with_a_short_window(path, tiny_tokenizer_dir))
        return build_once(shared_root(tmp_path_factory), f"arch sweep {model_type}",
                          lambda path: build_sweep_checkpoint(model_type, path, tiny_tokenizer_dir))
    return get


@pytest.fixture(scope="module")
def expected(checkpoint):
    tokens: dict[str, list[list[int]]] = {}

    def get(model_type: str) -> list[list[int]]:
        if model_type not in tokens:
            tokens[model_type] = oracle_tokens(checkpoint(model_type))
        return tokens[model_type]
    return get


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(model_type, layout) -> its LLM (chunked prefill of 16-token steps, prefix caching on)."""
    with engine_pool(lambda model_type, layout: LLM(str(checkpoint(model_type)),
                                                    **{**ENGINE_OPTIONS, **LAYOUTS[layout]})) as get:
        yield get


@pytest.mark.parametrize("model_type", ["hy_v4", "inkling_text", "doge_window", "minimax"])
def test_greedy_tokens_match_transformers_with_chunks_and_prefix_cache(engines, expected, model_type):
    llm = engines(model_type, "chunked")
    assert isinstance(llm.engine.client.core.model, TransformersCausalLM)
    first, second = (llm.generate([prompt], greedy(NEW_TOKENS))[0] for prompt in PROMPTS)
    assert [first.token_ids, second.token_ids] == expected(model_type)
    assert second.cached_prompt_tokens >= SHARED_PREFIX   # the shared prefix's entries came from the paged cache


@pytest.mark.parametrize("model_type", ["hy_v4", "inkling_text"])
def test_several_sequences_in_one_step(engines, expected, model_type):
    """Both prompts at once: prefill chunks and decodes of two sequences share steps, each run on its own."""
    llm = engines(model_type, "chunked")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(model_type)


def test_indexed_model_with_expert_parallel_and_dp_attention(engines, expected):
    """EP 2 x DP attention 2: each DP worker runs its sequences' indexed layers on its own paged cache; an idle one
    runs the stand-in token through them."""
    llm = engines("hy_v4", "ep2_dp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected("hy_v4")
    [alone] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))
    assert alone.token_ids == expected("hy_v4")[1]


def test_indexed_layers_sharing_state_along_the_row_are_refused_by_name(checkpoint):
    with pytest.raises(UnsupportedArchitectureError, match="kolibri1_1.*indexed_attention.*shared_kv_states"):
        LLM(str(checkpoint("kolibri1_1")), **ENGINE_OPTIONS)
