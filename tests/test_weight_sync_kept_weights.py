"""Weight updates reach every weight the engine keeps, in the form it keeps it (issue 54 item 2):

- an int4 release served as it ships (`--quantization` unset: its experts kept packed in the release's layout) takes
  a trainer's float experts and rounds them to that layout, as FP8 and int8 are quantized again: its slots and
  tokens equal those of the engine started with `--quantization int4` on a float checkpoint of those weights (the
  release here is GPTQ symmetric with group 128, the layout `--quantization int4` rounds a float checkpoint to);
- the MTP drafter (`speculative_config` method "mtp") loads the update's tensors of its layer too: after
  `update_weights(path)` to a checkpoint whose MTP layer differs, the drafter's parameters are the new ones.
"""
from __future__ import annotations

import pytest
import torch

import int4_checkpoints
from int4_checkpoints import write_int4_checkpoint
from moe_runtime import LLM, SamplingParams
from moe_runtime.kernels.int4_layout import Int4Layout
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint
from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors
from moe_runtime.weights.quantization.int4_in_memory import DEFAULT_INT4_LAYOUT

PROMPT = [5, 17, 42, 99, 3, 8, 61, 200, 31, 7, 12]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_an_int4_release_rounds_a_trainers_float_experts_to_its_layout(tiny_checkpoint_factory, tmp_path,
                                                                       monkeypatch):
    old, new = tiny_checkpoint_factory("mixtral"), tiny_checkpoint_factory("mixtral", seed=1)
    monkeypatch.setattr(int4_checkpoints, "GROUP_SIZE", DEFAULT_INT4_LAYOUT.group_size)
    release, _ = write_int4_checkpoint(old, tmp_path / "gptq", tmp_path / "twin", "gptq")
    float_tensors = read_all_tensors(new)
    with LLM(str(new), device="cpu", dtype="float32", quantization="int4") as rounded_at_start:
        expected = rounded_at_start.core.weight_updater.slot_checksums()
        expected_tokens = rounded_at_start.generate([PROMPT], GREEDY)[0].token_ids
    with LLM(str(release), device="cpu", dtype="float32") as served:
        experts = served.core.executor.expert_store(0)
        assert experts.quant is not None and experts.quant.layout == Int4Layout(DEFAULT_INT4_LAYOUT.group_size, False)
        assert not experts.quant.rounds_float_weights   # kept int4 by itself: a float expert in the release is refused
        updated = served.update_weights_from_tensors(float_tensors, checksums=True).checksums[0]
        assert experts.w13.dtype == torch.uint8
        assert updated == expected
        assert served.generate([PROMPT], GREEDY)[0].token_ids == expected_tokens


def drafter_parameters(llm) -> dict[str, torch.Tensor]:
    layer = llm.core.speculation.local_model_drafter().layer
    return {name: param.detach().clone() for name, param in layer.named_parameters()}


def test_the_mtp_drafter_takes_the_updates_tensors(tiny_checkpoint_factory, tmp_path):
    base = tiny_checkpoint_factory("deepseek_v3")
    old = write_mtp_checkpoint(base, tmp_path / "old", seed=0)
    new = write_mtp_checkpoint(base, tmp_path / "new", seed=1)
    with LLM(str(old), device="cpu", dtype="float32", speculative_config={"method": "mtp",
                                                                         "num_speculative_tokens": 2}) as llm:
        before = drafter_parameters(llm)
        llm.update_weights(str(new))
        after = drafter_parameters(llm)
    with LLM(str(new), device="cpu", dtype="float32", speculative_config={"method": "mtp",
                                                                         "num_speculative_tokens": 2}) as fresh:
        loaded = drafter_parameters(fresh)
    assert any(not torch.equal(before[name], loaded[name]) for name in loaded)   # the two MTP layers differ
    assert sorted(after) == sorted(loaded)
    for name, tensor in loaded.items():
        assert torch.equal(after[name], tensor), name
