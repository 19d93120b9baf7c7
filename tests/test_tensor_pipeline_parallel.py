"""Dense models as one expert split by TP and PP, and PP for MoE models: same greedy tokens as one rank."""
import pytest

from engine_helpers import PROMPTS, greedy
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.errors import InvalidRequestError

NEW_TOKENS = 10   # PROMPTS[1] prefills across a 16-token KV block, PROMPTS[3] decodes across one
FOUR_LAYERS = dict(num_hidden_layers=4)
DENSE_LAYOUTS = [dict(tp=2), dict(tp=4), dict(pp=2), dict(pp=4), dict(tp=2, pp=2)]


def _name(kwargs):
    return "-".join(f"{k}{v}" for k, v in kwargs.items())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", DENSE_LAYOUTS, ids=_name)
def test_dense_layouts_match_one_rank(arch, layout, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch, **FOUR_LAYERS)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    with LLM(str(path), device="cpu", dtype="float32", **layout) as llm:
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        ready = llm.engine.client.job.ready
    assert [o.token_ids for o in outputs] == expected
    # each rank holds only its stage's layers (and its TP share of them): well under the whole model
    whole = checkpoint_bytes(path)
    share = 1 / (layout.get("pp", 1) * layout.get("tp", 1))
    for rank, r in ready.items():
        assert r.weight_bytes <= (share + 0.2) * whole, f"rank {rank} holds {r.weight_bytes} of {whole} bytes"


def checkpoint_bytes(path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                numel = 1
                for dim in tensor.get_shape():
                    numel *= dim
                total += numel * 4  # fp32 checkpoints
    return total


def test_tp_beyond_kv_heads_replicates_them(tiny_checkpoint_factory, caplog):
    path = tiny_checkpoint_factory("llama", num_key_value_heads=2)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    with caplog.at_level("WARNING"), LLM(str(path), device="cpu", dtype="float32", tp=4) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
    assert any("replicated on 2 ranks" in r.getMessage() for r in caplog.records), "the memory cost was not reported"


@pytest.mark.parametrize("arch, layout", [("mixtral", dict(pp=2, ep=2)), ("deepseek_v3", dict(pp=2, ep=2, dp_attn=2))])
def test_moe_pipeline_with_expert_parallel_stages(arch, layout, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch, **FOUR_LAYERS)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    with LLM(str(path), device="cpu", dtype="float32", pp_micro_batches=2, **layout) as llm:
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        [single] = llm.generate([PROMPTS[2]], greedy(NEW_TOKENS))  # other DP workers idle in both stages
        snapshot = llm.expert_load()
    assert [o.token_ids for o in outputs] == expected
    assert single.token_ids == expected[2]
    assert snapshot.counts.shape[0] == 4 - (1 if arch == "deepseek_v3" else 0), "MoE layers of both stages"


@pytest.mark.parametrize("arch, kwargs, message", [
    ("llama", dict(tp=3), r"tp=3 does not divide the 8 attention heads"),
    ("llama", dict(pp=2, pp_layers=(1, 2)), r"pp_layers=\[1, 2\] must give 2 stages"),
    ("llama", dict(pp=5), r"pp=5 exceeds the model's 2 layers"),
    ("mixtral", dict(tp=2), r"tensor parallelism is for dense models"),
    ("llama", dict(tp=2, ep=2), r"tp splits dense models"),
])
def test_invalid_tp_pp_sizes_are_rejected(arch, kwargs, message, tiny_checkpoint_factory):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(tiny_checkpoint_factory(arch)), device="cpu", **kwargs)


def test_intermediate_not_divisible(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama", intermediate_size=250)
    with pytest.raises(InvalidRequestError, match=r"tp=4 does not divide intermediate_size=250"):
        LLM(str(path), device="cpu", tp=4)
