"""Bad checkpoints give errors that name the file, tensor or architecture at fault."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from moe_runtime import LLM
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.errors import CheckpointError, UnsupportedArchitectureError
from moe_runtime.moe.expert_weights import ExpertWeights


@pytest.fixture
def checkpoint_copy(tiny_checkpoint_factory, tmp_path):
    def copy(arch="mixtral", sharded=False):
        target = tmp_path / f"{arch}-copy"
        shutil.copytree(tiny_checkpoint_factory(arch, sharded=sharded), target)
        return target
    return copy


def test_missing_directory():
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM("/nonexistent/checkpoint", device="cpu")


def test_missing_config(checkpoint_copy):
    path = checkpoint_copy()
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(path), device="cpu")


def test_unknown_architecture(checkpoint_copy):
    path = checkpoint_copy()
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FrobnicatorForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="FrobnicatorForCausalLM"):
        LLM(str(path), device="cpu")


def test_missing_tensor_is_named(checkpoint_copy):
    path = checkpoint_copy()
    tensors = load_file(str(path / "model.safetensors"))
    victim = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    del tensors[victim]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        LLM(str(path), device="cpu")


def test_mismatched_tensor_shape_is_named(checkpoint_copy):
    path = checkpoint_copy()
    tensors = load_file(str(path / "model.safetensors"))
    victim = "model.layers.0.self_attn.k_proj.weight"
    tensors[victim] = tensors[victim][:-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{victim.replace('.', '[.]')}.*shape"):
        LLM(str(path), device="cpu")


def test_missing_weights_file(checkpoint_copy):
    path = checkpoint_copy()
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(str(path), device="cpu")


def test_missing_shard_is_named(checkpoint_copy):
    path = checkpoint_copy("qwen3_moe", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        LLM(str(path), device="cpu")


def test_expert_subset_reads_only_its_experts(tiny_checkpoint_factory):
    """Expert parallelism asks for a subset: only those experts' tensors are read."""
    path = tiny_checkpoint_factory("qwen3_moe")
    reader = CheckpointReader.open(path)
    experts = ExpertWeights([1, 3], hidden_size=128, intermediate_size=_moe_intermediate(path))
    loaded = experts.load_weights(reader, "model.layers.0.mlp.experts.")
    assert loaded == {"w13", "w2"}
    assert reader.tensors_read == 2 * 3  # gate, up, down of two experts, nothing else
    full = load_file(str(path / "model.safetensors"))
    inter = experts.intermediate_size
    assert (experts.w13[1, :inter] == full["model.layers.0.mlp.experts.3.gate_proj.weight"]).all()
    assert (experts.w2[0] == full["model.layers.0.mlp.experts.1.down_proj.weight"]).all()


def _moe_intermediate(path):
    return json.loads((path / "config.json").read_text())["moe_intermediate_size"]
