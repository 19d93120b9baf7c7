"""The transformers backend split over ranks by the model's own plans (transformers_backend/tensor_parallel.py,
pipeline_stages.py): `--model-impl transformers` under tensor parallelism, pipeline stages, and expert parallelism
with attention TP gives transformers' greedy tokens, each rank holding its share of the weights; models whose
plans are missing or use styles not implemented are refused by name.

Tiny 4-layer checkpoints (two layers per stage), chunked 16-token steps (some pipeline micro-batches are empty),
a prompt repeated to hit the prefix cache. Engines are module-scoped and built on first use.
"""
from __future__ import annotations

import re
import shutil

import pytest

from engine_helpers import greedy
from lazy_engines import engine_pool
from shared_builds import build_once, shared_root
from test_tensor_pipeline_parallel import checkpoint_bytes
from tiny_checkpoints import HFOracle, build_model
from transformers_backend_cases import CHUNKED, NEW_TOKENS, PROMPTS, SMALL as BASE_SHAPE
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.models.transformers_backend.pipeline_stages import pp_refusal
from moe_runtime.models.transformers_backend.tensor_parallel import tp_refusal

SMALL = dict(BASE_SHAPE, num_hidden_layers=4)


def _config(name: str):
    import transformers as t

    return {
        # q/k norms (replicated), layers 2-3 slide (window 8): two KV cache groups, split by heads and by stages
        "qwen3": lambda: t.Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=2),
        # no native port: a dense first layer, shared experts split by the plan, routed experts by EP
        "dots1": lambda: t.Dots1Config(**SMALL, moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=8,
                                       n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                       norm_topk_prob=True, routed_scaling_factor=1.5, sliding_window=None),
        "gpt_neox": lambda: t.GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=512),
    }[name]()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    def build(name: str, path):
        build_model(_config(name)).save_pretrained(str(path), safe_serialization=True)
        for file in sorted(tiny_tokenizer_dir.iterdir()):
            if file.is_file():
                shutil.copyfile(file, path / file.name)

    return lambda name: build_once(shared_root(tmp_path_factory), f"transformers backend parallel {name}",
                                   lambda path: build(name, path))


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(name, layout) -> its LLM through the transformers backend."""
    layouts = {"tp2": dict(tp=2), "pp2": dict(pp=2), "pp2_ep2": dict(pp=2, ep=2)}
    with engine_pool(lambda name, layout: LLM(str(checkpoint(name)), device="cpu", dtype="float32",
                                              model_impl="transformers", **CHUNKED, **layouts[layout])) as get:
        yield get


def _expected(checkpoint, name: str) -> list[list[int]]:
    return HFOracle(checkpoint(name)).greedy(PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("layout, share", [("tp2", 0.5), ("pp2", 0.5)])
def test_dense_tensor_and_pipeline_parallel(engines, checkpoint, layout, share):
    """tp 2: heads, MLP, embedding and LM head split by Qwen3's tp_plan; pp 2: two layers per stage, the
    embedding on the first, the norm and head on the last."""
    llm = engines("qwen3", layout)
    expected = _expected(checkpoint, "qwen3")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
    [again] = llm.generate([PROMPTS[0]], greedy(NEW_TOKENS))   # its first two blocks from the prefix cache
    assert again.token_ids == expected[0]
    whole = checkpoint_bytes(checkpoint("qwen3"))
    for rank, ready in llm.engine.client.job.ready.items():
        assert ready.weight_bytes <= (share + 0.05) * whole, f"rank {rank} holds {ready.weight_bytes} of {whole}"


def test_moe_pipeline_stages_with_expert_parallel_attention_tp(engines, checkpoint):
    """pp 2 x ep 2 with one DP attention worker per stage: attention TP 2 over each stage's EP group (heads and
    the shared experts split by dots1's tp_plan), routed experts dispatched by the executor."""
    llm = engines("dots1", "pp2_ep2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == _expected(checkpoint, "dots1")
    load = llm.expert_load()   # the three MoE layers of both stages went through the executor
    assert tuple(load.counts.shape) == (3, 8) and load.counts.sum() > 0


@pytest.mark.parametrize("refusal, pattern", [
    (lambda: tp_refusal("OPTForCausalLM", 2), "OPTConfig has no base_model_tp_plan"),
    (lambda: tp_refusal("Llama4ForCausalLM", 2), "'moe_tp_experts', 'packed_rowwise'"),
    (lambda: pp_refusal("OPTForCausalLM", 2), "OPTConfig has no base_model_pp_plan"),
    (lambda: pp_refusal("GPTNeoXForCausalLM", 2), r"'embed_in', 'final_layer_norm', 'layers'\]"),
])
def test_models_without_implemented_plans_are_refused_by_name(refusal, pattern):
    assert tp_refusal("Qwen3ForCausalLM", 2) is None and pp_refusal("Dots1ForCausalLM", 2) is None
    assert refusal() is not None
    assert re.search(pattern, refusal())


def test_refused_before_any_rank_starts(checkpoint):
    """GPT-NeoX's pp_plan names its own stage modules (embed_in, final_layer_norm): refused at the front."""
    with pytest.raises(EngineConfigError, match=r"--pp 2 \(its base_model_pp_plan names"):
        LLM(str(checkpoint("gpt_neox")), device="cpu", dtype="float32", model_impl="transformers", pp=2)
