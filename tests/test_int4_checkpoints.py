"""int4 releases load as they ship and keep their routed experts packed: compressed-tensors pack-quantized (W4A16
symmetric group 32, Kimi K2 Thinking / K2.5's experts' scheme, and W4A16_ASYM), AWQ gemm, GPTQ without and with
act order. Each tiny checkpoint is written in the format's documented layout (compressed-tensors by the library
itself, AWQ and GPTQ by tests/int4_checkpoints.py's own packer) beside its exactly dequantized twin; the reader
unpacks it into the int4 layout exactly, and the engine, asked for no quantization, keeps the experts in int4 as
stored and gives transformers' greedy tokens on the twin, on one rank and under expert parallelism."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compressed_tensors_checkpoints import write_compressed_checkpoint
from engine_helpers import greedy
from int4_checkpoints import AWQ_ORDER, write_int4_checkpoint
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.int4_layout import Int4Layout, packed_int4_columns
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.kernels import get_kernels
from moe_runtime.moe.expert_weights import MIXTRAL_NAMING, ExpertWeights
from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.command import Launch
from moe_runtime.planner.memory import resolve_precision
from moe_runtime.planner.model_shape import load_model_shape, model_shape_of
from moe_runtime.config.quantization_choice import kept_quantization
from moe_runtime.weights.quantization.in_memory import engine_quantization, weights_in_memory
from moe_runtime.weights.quantization.int4_in_memory import Int4InMemory
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors
from moe_runtime.weights.quantization.int32_nibbles import unpack_words
from moe_runtime.config.model_config import load_hf_config

ARCH = "mixtral"
PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(13)], [(11 * i + 1) % 380 + 9 for i in range(6)]]
NEW_TOKENS = 6
GROUP = 32
TORCH = get_kernels("cpu", "torch")
FORMATS = {   # name -> (writer, the experts' layout the reader must find)
    "compressed_w4a16": (lambda src, dst, twin: write_compressed_checkpoint(src, dst, twin, "W4A16"),
                         Int4Layout(GROUP, zero_points=False)),
    "compressed_w4a16_asym": (lambda src, dst, twin: write_compressed_checkpoint(src, dst, twin, "W4A16_ASYM"),
                              Int4Layout(GROUP, zero_points=True)),
    "awq": (lambda src, dst, twin: write_int4_checkpoint(src, dst, twin, "awq"), Int4Layout(GROUP, True)),
    "gptq": (lambda src, dst, twin: write_int4_checkpoint(src, dst, twin, "gptq"), Int4Layout(GROUP, False)),
    "gptq_desc_act": (lambda src, dst, twin: write_int4_checkpoint(src, dst, twin, "gptq", desc_act=True),
                      Int4Layout(GROUP, True, column_groups=True)),
}
ENGINE_FORMATS = [name for name in FORMATS if name != "compressed_w4a16_asym"]   # test_compressed_tensors.py runs
# W4A16_ASYM's engine against its twin (kept int4 by itself as well); its experts' unpacking is checked here
EXPERT = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
ATTENTION = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """`get(format) -> (packed, twin)`, each written once per module."""
    source = tiny_checkpoint_factory(ARCH)
    root = tmp_path_factory.mktemp("int4_checkpoints")
    written: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in written:
            writer, _ = FORMATS[name]
            written[name] = writer(source, root / name, root / f"{name}_twin")
        return written[name]
    return get


def open_reader(path: Path) -> CheckpointReader:
    return CheckpointReader.open(path, None, load_hf_config(path))


def test_awq_packs_its_nibbles_in_interleaved_order_and_gptq_in_plain_order():
    word = torch.tensor([[0x76543210]], dtype=torch.int32)   # nibble i holds i
    assert unpack_words(word, 1, AWQ_ORDER).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert unpack_words(word, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_words(word, 0).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    negative = torch.tensor([[-0x1]], dtype=torch.int32)      # the sign bit is the last nibble's high bit
    assert unpack_words(negative, 1).tolist() == [[15] * 8]


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_reader_unpacks_every_weight_exactly(checkpoints, name):
    packed, twin = checkpoints(name)
    reader, dense = open_reader(packed), read_all_tensors(twin)
    layout = FORMATS[name][1]
    assert reader.int4_experts_layout() == layout
    weight = reader.read_int4(EXPERT)
    rows, columns = dense[EXPERT].shape
    assert weight.values.dtype == torch.uint8 and weight.values.shape == (rows, packed_int4_columns(columns))
    assert torch.equal(weight.dequantized(layout), dense[EXPERT])
    assert reader.read_int4("model.layers.0.block_sparse_moe.gate.weight") is None   # the router stays float
    assert reader.shape(ATTENTION) == tuple(dense[ATTENTION].shape)
    for tensor_name in reader.names():   # attention and the rest: dequantized exactly, as the twin holds them
        assert torch.equal(reader.read(tensor_name).to(dense[tensor_name].dtype), dense[tensor_name]), tensor_name
    assert torch.equal(reader.read_slice(ATTENTION, 0, 8, 24), dense[ATTENTION][8:24])
    if name.startswith("compressed"):   # the library's own decompress on the stored tensors gives the same weight
        module = reader.compressed.modules[EXPERT]
        library = module.compressor.decompress(
            {local: reader._read_parameter(stored) for local, stored in module.params.items()}, module.scheme)
        assert torch.equal(weight.dequantized(layout, library["weight"].dtype), library["weight"])


@pytest.fixture(scope="module")
def greedy_runs(checkpoints):
    """`run(format, **llm_options) -> (tokens, experts of layer 0)` and the twin's oracle tokens."""
    def run(name: str, **options):
        packed, twin = checkpoints(name)
        with LLM(str(packed), device="cpu", dtype="float32", **options) as llm:
            tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
            experts = (None if options.get("ep", 1) > 1 else
                       [m for m in llm.core.model.modules() if isinstance(m, ExpertWeights)])
        return tokens, experts, hf_greedy(twin, PROMPTS, NEW_TOKENS)
    return run


@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_an_int4_release_keeps_its_experts_packed_and_gives_the_twins_tokens(greedy_runs, name):
    tokens, experts, oracle = greedy_runs(name)
    assert tokens == oracle
    layout = FORMATS[name][1]
    for stack in experts:
        assert stack.quant.name == "int4" and stack.quant.layout == layout
        assert stack.w13.dtype == torch.uint8 and stack.w2.dtype == torch.uint8
        e, hidden, inter = stack.num_local_experts, stack.hidden_size, stack.intermediate_size
        packed_bytes = e * (2 * inter * packed_int4_columns(hidden) + hidden * packed_int4_columns(inter))
        scale_bytes = 4 * e * (2 * inter * layout.groups(hidden) + hidden * layout.groups(inter))
        scale_bytes *= 2 if layout.zero_points else 1
        group_bytes = 4 * e * (hidden + inter) if layout.column_groups else 0
        assert stack.resident_bytes() == packed_bytes + scale_bytes + group_bytes
        assert stack.resident_bytes() < e * 3 * hidden * inter * 2 / 2   # under half of bf16's bytes


def test_an_int4_release_under_expert_parallelism_with_dp_attention(greedy_runs):
    tokens, _, oracle = greedy_runs("gptq_desc_act", ep=2, dp_attn=2)
    assert tokens == oracle


def test_an_explicit_quantization_wins_over_the_checkpoints_int4():
    def kept(stored_int4: bool, **options):
        choice = kept_quantization(EngineConfig(model="m", **options), stored_int4)
        return choice.quantization, choice.automatic
    assert kept(True) == ("int4", True)
    assert kept(False) == (None, False)
    assert kept(True, quantization="int8") == ("int8", False)
    assert kept(True, quantization="int4") == ("int4", False)   # asked for: rounds a float expert weight
    assert kept(True, quantization="none") == (None, False)     # every weight in --dtype
    assert kept(True, cpu_experts=True) == (None, False)        # no host int4 kernels
    for option in ("cpu_experts", "enable_torch_compile", "deterministic"):   # options that run weights in --dtype
        EngineConfig(model="m", quantization="none", **{option: True}).validate_options()


def test_quantization_none_serves_an_int4_release_dequantized_in_dtype(greedy_runs):
    """--quantization none (review of issue 52, #6): the release's experts dequantized at load, as the twin holds
    them, where unset keeps them packed."""
    tokens, experts, oracle = greedy_runs("awq", quantization="none")
    assert tokens == oracle
    assert all(stack.quant is None and stack.w13.dtype == torch.float32 for stack in experts)


def _with_one_expert_module_in_float(packed: Path, twin: Path, target: Path) -> Path:
    """The release with one routed-expert module shipped unquantized (an `ignore` / `modules_to_not_convert`
    entry): its twin's float weight in place of its qweight, qzeros and scales."""
    shutil.copytree(packed, target)
    module = EXPERT.removesuffix(".weight")
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = target / index["weight_map"][f"{module}.qweight"]
    tensors = load_file(file)
    for local in ("qweight", "qzeros", "scales"):
        del tensors[f"{module}.{local}"]
        del index["weight_map"][f"{module}.{local}"]
    tensors[EXPERT] = read_all_tensors(twin)[EXPERT]
    index["weight_map"][EXPERT] = file.name
    save_file(tensors, file, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return target


def test_int4_kept_by_itself_refuses_an_expert_weight_shipped_in_float(checkpoints, tmp_path):
    """Review of issue 52, #2: unset --quantization rounded the float module to int4 behind the user's back; it is
    refused by name, and an asked-for --quantization int4 rounds it."""
    reader = open_reader(_with_one_expert_module_in_float(*checkpoints("awq"), tmp_path / "partial"))
    layout = reader.int4_experts_layout()
    for options, automatic in (({}, True), ({"quantization": "int4"}, False)):
        kept = engine_quantization(EngineConfig(model="m", **options), layout)
        assert kept.automatic == automatic
        quant = weights_in_memory(kept.quantization, None, TORCH, layout, rounds_float_experts=not kept.automatic)
        if automatic:
            with pytest.raises(CheckpointError, match=re.escape(EXPERT) + ".*stored unquantized.*--quantization int4 "
                                                      "to round it.*--quantization none"):
                quant.read(reader, EXPERT)
            with pytest.raises(CheckpointError, match=re.escape(EXPERT)):
                quant.read_slice(reader, EXPERT, 0, 0, 8)
        else:
            assert quant.read(reader, EXPERT).values.dtype == torch.uint8


def _rewritten(path: Path, target: Path, quantization: dict | None = None) -> Path:
    shutil.copytree(path, target)
    if quantization is not None:
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"].update(quantization)
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("name, change, named", [
    ("awq", {"bits": 8}, "AWQ quantization_config.bits 8"),
    ("awq", {"version": "gemv"}, "AWQ quantization_config.version 'gemv'"),
    ("gptq", {"bits": 3}, "GPTQ quantization_config.bits 3"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
])
def test_an_int4_config_the_reader_cannot_read_is_refused_by_name(checkpoints, tmp_path, name, change, named):
    path = _rewritten(checkpoints(name)[0], tmp_path / "changed", change)
    with pytest.raises(CheckpointError, match=named):
        open_reader(path)


def test_gptq_act_order_with_gate_and_up_grouped_apart_is_refused_by_name(checkpoints, tmp_path):
    path = _rewritten(checkpoints("gptq_desc_act")[0], tmp_path / "apart")
    up = "model.layers.0.block_sparse_moe.experts.2.w3.g_idx"
    for shard in path.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if up in tensors:
            tensors[up] = tensors[up].roll(1)
            save_file(tensors, str(shard), metadata={"format": "pt"})
    reader = open_reader(path)
    experts = ExpertWeights([1, 2], 128, 96, MIXTRAL_NAMING, quant=Int4InMemory(TORCH, reader.int4_experts_layout()))
    with pytest.raises(CheckpointError, match=r"experts\.2\.w3\.weight.*column groups \(g_idx\) differ"):
        experts.load_weights(reader, "model.layers.0.block_sparse_moe.experts.")


def test_expert_weights_of_two_int4_layouts_are_refused_by_name(checkpoints):
    reader = open_reader(checkpoints("awq")[0])
    other = reader.int4.modules[EXPERT]
    mixed = dict(reader.int4.modules)
    mixed[EXPERT] = type(other)(EXPERT, other.params, type(other.format)(Int4Layout(64, True)))
    with pytest.raises(CheckpointError, match=r"expert weights mix int4 layouts .*experts\.3\.w1\.weight"):
        type(reader.int4)(reader.int4.method, mixed, True).experts_layout("here")


def test_a_reclaimed_slot_reloads_its_int4_expert_as_stored(checkpoints):
    """A slot whose rank was lost reloads its expert from the checkpoint, opened again as the engine opened it (its
    int4 format included)."""
    reader = open_reader(checkpoints("gptq_desc_act")[0])
    prefix = "model.layers.1.block_sparse_moe.experts."
    experts = ExpertWeights([3, 5], 128, 96, MIXTRAL_NAMING, quant=Int4InMemory(TORCH, reader.int4_experts_layout()))
    experts.load_weights(reader, prefix)
    held = [t[0].clone() for t in experts.slot_tensors()]
    experts.reload_slot(1, 3)
    assert experts.expert_ids == [3, 3]
    for tensor, stored in zip(experts.slot_tensors(), held):
        assert torch.equal(tensor[1], stored)


def test_the_planner_counts_an_int4_releases_experts_in_int4(checkpoints):
    awq, twin = checkpoints("awq")
    assert resolve_precision(load_model_shape(awq), "float32", None).quantization == "int4"
    assert resolve_precision(load_model_shape(awq), "float32", "int8").quantization == "int8"
    assert resolve_precision(load_model_shape(twin), "float32", None).quantization is None
    kimi_scheme = load_model_shape(checkpoints("compressed_w4a16")[0])
    assert resolve_precision(kimi_scheme, "float32", None).quantization == "int4"


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_planner_prices_int4_experts_in_the_releases_own_layout(checkpoints, name):
    """Review of issue 52, #1: every release was priced at group 128 without zero points (Kimi's group 32: 17.6%
    under what the engine keeps). The price is the kept stack's bytes (codes, float32 scales and zero points, act
    order's column groups) per weight, by the layout's own shapes; and it is int4 only where the engine keeps int4."""
    shape = load_model_shape(checkpoints(name)[0])
    hidden, inter = shape.hidden_size, shape.expert_intermediate
    quant = Int4InMemory(TORCH, FORMATS[name][1])
    kept = sum(torch.Size(quant.values_shape(rows, columns)).numel() + 4 * torch.Size(quant.scale_shape(rows, columns)).numel()
               + (4 * columns if quant.column_groups else 0) for rows, columns in ((2 * inter, hidden), (hidden, inter)))
    for asked in (None, "int4"):   # an asked-for int4 keeps the release's layout too
        assert resolve_precision(shape, "float32", asked).expert_bytes == pytest.approx(kept / (3 * hidden * inter))
    assert resolve_precision(shape, "float32", None, cpu_experts=True).quantization is None   # the engine's rule
    assert resolve_precision(shape, "float32", "none").expert_bytes == 4
    def flags(asked):   # the planned command asks for what the plan priced
        return Launch("m", "cpu", resolve_precision(shape, "float32", asked), ParallelLayout(), 1, 1, 1).flags()
    assert "--quantization" not in flags(None)   # unset keeps them int4 by itself
    assert " ".join(flags("none")).count("--quantization none") == 1


@pytest.mark.parametrize("quant", [
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"attention": {
        "targets": ["re:.*self_attn.*"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                                     "symmetric": True}}}},
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:.*experts.*"], "config_groups": {
        "all": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "modules_to_not_convert": ["experts"]},
], ids=["int4-attention-only", "experts-ignored", "awq-experts-not-converted"])
def test_the_planner_prices_experts_the_release_keeps_in_float_in_dtype(checkpoints, quant):
    config = json.loads((checkpoints("awq")[0] / "config.json").read_text())
    shape = model_shape_of({**config, "quantization_config": quant})
    assert shape.int4_experts is None
    assert resolve_precision(shape, "float32", None).quantization is None
