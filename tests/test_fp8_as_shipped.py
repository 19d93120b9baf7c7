"""FP8 releases kept FP8 as they ship: Llama 4 Maverick-FP8 (fbgemm row-wise, tests/fbgemm_fp8_checkpoints.py) and
compressed-tensors' float-quantized FP8 per tensor, channel and block (GLM-4.x FP8's format, written by the library:
tests/compressed_tensors_checkpoints.py). By default the weights are dequantized at load, exactly; with
`--quantization fp8` every stored FP8 weight stays its stored bytes (a per-row or per-tensor scale is a row-expanded
block scale repeated over the row's blocks; a block scale sets the engine's column block), and both give
transformers' greedy tokens on the dequantized twin, on one rank and under expert parallelism with DP attention."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Llama4TextConfig
from transformers.integrations.fbgemm_fp8 import FbgemmFp8Linear, FbgemmFp8Llama4TextExperts

from compressed_tensors_checkpoints import BLOCK, write_compressed_checkpoint
from engine_helpers import greedy
from fbgemm_fp8_checkpoints import PREFIX, write_maverick_fp8
from lazy_engines import lazy_engines
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.errors import CheckpointError
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors
from moe_runtime.weights.quantization.fp8_in_memory import row_expanded_scales

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(21)], [(11 * i + 1) % 380 + 9 for i in range(9)]]
NEW_TOKENS = 8
MAVERICK_LAYOUTS = {
    "one_rank": {},
    "one_rank_fp8": dict(quantization="fp8"),
    "ep2_dp2_fp8": dict(quantization="fp8", ep=2, dp_attn=2),
}
MOE_LAYER = 1   # the tiny Llama 4's layers 1 and 3 are MoE


@pytest.fixture(scope="module")
def maverick(tiny_checkpoint_factory, tmp_path_factory):
    """(twin, release) from the tiny Llama 4 text checkpoint."""
    return write_maverick_fp8(tiny_checkpoint_factory("llama4"), tmp_path_factory.mktemp("maverick_fp8"))


@pytest.fixture(scope="module")
def maverick_engines(maverick):
    with lazy_engines(maverick[1], MAVERICK_LAYOUTS, device="cpu", dtype="float32") as get:
        yield get


@pytest.fixture(scope="module")
def maverick_expected(maverick):
    tokens = hf_greedy(maverick[0], PROMPTS, NEW_TOKENS)
    assert max(len(set(continuation)) for continuation in tokens) > 2, "degenerate oracle tokens"
    return tokens


def test_maverick_release_is_transformers_fbgemm_layout_and_reads_back_as_its_twin(maverick):
    twin_dir, release_dir = maverick
    release, twin = load_file(str(release_dir / "model.safetensors")), load_file(str(twin_dir / "model.safetensors"))
    config = load_hf_config(release_dir)
    experts = FbgemmFp8Llama4TextExperts(Llama4TextConfig(**config.to_dict()))
    stack = f"{PREFIX}model.layers.{MOE_LAYER}.feed_forward.experts."
    for name, param in experts.named_parameters():
        assert release[stack + name].dtype == param.dtype and release[stack + name].shape == param.shape, name
    q_proj = f"{PREFIX}model.layers.0.self_attn.q_proj."
    linear = FbgemmFp8Linear(config.hidden_size, release[q_proj + "weight"].shape[0], bias=False)
    assert release[q_proj + "weight"].dtype == linear.weight.dtype and release[q_proj + "weight_scale"].shape == \
        linear.weight_scale.shape
    reader = CheckpointReader.open(release_dir, None, config)
    for name, tensor in twin.items():
        assert torch.equal(reader.read(name), tensor), name
    rows = reader.read_rows(f"model.layers.{MOE_LAYER}.feed_forward.experts.down_proj", 5, 7)
    assert torch.equal(rows, twin[f"model.layers.{MOE_LAYER}.feed_forward.experts.down_proj"][5:7])
    assert {name for name in reader.names() if name not in reader.consumed} == \
        {name for name in release if not name.startswith(PREFIX)}   # every scale read; the vision tower not


def test_maverick_fp8_gives_transformers_tokens_dequantized(maverick_engines, maverick_expected):
    assert [o.token_ids for o in maverick_engines("one_rank").generate(PROMPTS, greedy(NEW_TOKENS))] == \
        maverick_expected


def test_maverick_fp8_keeps_the_stored_bytes(maverick_engines, maverick_expected, maverick):
    """Routed experts (transposed to [outputs, inputs], bytes moved), shared expert and attention hold the release's
    FP8 values and scales; the tokens are transformers' on the twin."""
    llm = maverick_engines("one_rank_fp8")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == maverick_expected
    release = load_file(str(maverick[1] / "model.safetensors"))
    layer = llm.core.model.model.layers[MOE_LAYER]
    experts, stored = layer.feed_forward.experts, f"{PREFIX}model.layers.{MOE_LAYER}.feed_forward."
    assert experts.w13.dtype == torch.float8_e4m3fn
    for slot, expert in enumerate(experts.expert_ids):
        for kept, scale, name in ((experts.w13, experts.w13_scale, "gate_up_proj"),
                                  (experts.w2, experts.w2_scale, "down_proj")):
            values = release[f"{stored}experts.{name}"][expert].transpose(0, 1)          # [outputs, inputs]
            assert torch.equal(kept[slot].view(torch.uint8), values.contiguous().view(torch.uint8)), name
            per_row = release[f"{stored}experts.{name}_scale"][expert].reshape(-1, 1)    # [outputs, 1]
            assert torch.equal(scale[slot], per_row.expand_as(scale[slot])), name
    shared, o_proj = layer.feed_forward.shared_expert, layer.self_attn.o_proj   # a DenseMLP: w2[0] is down_proj
    for module, values, scale in ((f"{stored}shared_expert.down_proj.", shared.w2[0], shared.w2_scale[0]),
                                  (f"{PREFIX}model.layers.{MOE_LAYER}.self_attn.o_proj.", o_proj.weight,
                                   o_proj.weight_scale)):
        assert torch.equal(values.view(torch.uint8), release[module + "weight"].view(torch.uint8)), module
        assert torch.equal(scale, release[module + "weight_scale"].expand_as(scale)), module


@pytest.mark.slow
def test_maverick_fp8_under_expert_parallelism_with_dp_attention(maverick_engines, maverick_expected):
    """Each EP rank keeps its own experts' stored FP8 bytes (read one expert at a time)."""
    assert [o.token_ids for o in maverick_engines("ep2_dp2_fp8").generate(PROMPTS, greedy(NEW_TOKENS))] == \
        maverick_expected


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_compressed_tensors_fp8_is_kept_as_stored(preset, tiny_checkpoint_factory, tmp_path):
    """Per tensor, per channel, per 32x32 block: every projection keeps its stored FP8 values bit for bit, its
    scale as row-expanded blocks (the checkpoint's 32 columns for block scales), and the tokens are the twin's."""
    compressed, twin = write_compressed_checkpoint(tiny_checkpoint_factory("mixtral"), tmp_path / "compressed",
                                                   tmp_path / "twin", preset)
    stored = read_all_tensors(compressed)
    with LLM(str(compressed), device="cpu", dtype="float32", quantization="fp8") as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == hf_greedy(twin, PROMPTS, NEW_TOKENS)
        layer = llm.core.model.model.layers[1]
        block_k = layer.self_attn.q_proj.quant.block_k
        assert block_k == (BLOCK[1] if preset == "FP8_BLOCK" else 128)
        q_proj = "model.layers.1.self_attn.q_proj."
        values = stored[q_proj + "weight"]
        assert torch.equal(layer.self_attn.q_proj.weight.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(layer.self_attn.q_proj.weight_scale,
                           row_expanded_scales(stored[q_proj + "weight_scale"], *values.shape, block_k, q_proj,
                                               tuple(BLOCK) if preset == "FP8_BLOCK" else None))
        experts = layer.block_sparse_moe.experts
        slot = experts.expert_ids.index(3)
        gate, up = (stored[f"model.layers.1.block_sparse_moe.experts.3.{w}.weight"] for w in ("w1", "w3"))
        assert torch.equal(experts.w13[slot].view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))


def test_row_expanded_scales_repeat_stored_scales_exactly_or_refuse():
    grid = torch.tensor([[1.0, 2.0], [3.0, 4.0]])   # blocks of 2 rows x 64 columns over a [3, 100] weight
    assert torch.equal(row_expanded_scales(grid, 3, 100, 32, "w", (2, 64)),
                       torch.tensor([[1.0, 1, 2, 2], [1, 1, 2, 2], [3, 3, 4, 4]]))
    assert torch.equal(row_expanded_scales(torch.tensor([0.5]), 2, 100, 32, "w"), torch.full((2, 4), 0.5))
    assert torch.equal(row_expanded_scales(torch.tensor([[1.0], [2.0]]), 2, 100, 128, "w"),
                       torch.tensor([[1.0], [2.0]]))
    with pytest.raises(CheckpointError, match="64-column blocks cannot be kept as blocks of 128"):
        row_expanded_scales(grid, 3, 100, 128, "w", (2, 64))
    with pytest.raises(CheckpointError, match="no block size was given"):
        row_expanded_scales(grid, 3, 100, 32, "w")


def test_an_fbgemm_fp8_tensor_without_its_scale_or_with_a_wrong_one_is_refused_by_name(tmp_path):
    values = torch.ones(4, 8).to(torch.float8_e4m3fn)
    save_file({"a.weight": values, "b.weight": values.clone(), "b.weight_scale": torch.ones(1, 4)},
              str(tmp_path / "model.safetensors"))
    config = SimpleNamespace(quantization_config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0})
    reader = CheckpointReader.open(tmp_path, None, config)
    with pytest.raises(CheckpointError, match=r"'a.weight' .* without its scales 'a.weight_scale'"):
        reader.read("a.weight")
    with pytest.raises(CheckpointError, match=r"b.weight: .* one scale per row \(4, 1\), got \(1, 4\)"):
        reader.read_fp8_rows("b.weight", 128)
