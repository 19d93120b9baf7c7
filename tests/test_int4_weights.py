"""`--quantization int4`: routed experts kept as packed int4 codes with float32 group scales (issue 52).

Kernels: the torch family against `dequantize_int4` (moe_runtime/kernels/int4_layout.py, the layout's one rule)
followed by the plain dense ops, over the layout's variants: symmetric groups, zero points, one scale per row
(channel), act order's column groups, an odd number of columns and a last partial group. The kernels decode each
chunk to exactly the rule's fp32 weight, so fp32 agrees to summation order (rtol = atol = 1e-4, outputs O(1)-O(10));
bf16 activations are computed in fp32 on CPU and rounded once (rtol 8e-3).

Engine: a float checkpoint's experts are quantized at load (groups of 128, symmetric); the oracle is transformers
on the twin checkpoint whose expert weights are those int4 values dequantized (written here with the format's own
quantizer), so a correct loader and kernel family give its greedy tokens exactly.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from engine_helpers import PROMPTS, greedy
from safetensors.torch import save_file
from tiny_checkpoints import hf_greedy

from moe_runtime import LLM
from moe_runtime.errors import CheckpointError
from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.int4_layout import Int4Layout, dequantize_int4, pack_int4
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.server.cli import build_parser, engine_config_from_args
from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors
from moe_runtime.weights.quantization.in_memory import weights_in_memory
from moe_runtime.weights.quantization.int4_in_memory import (DEFAULT_INT4_LAYOUT, Int4InMemory, Int4Rows,
                                                               quantize_int4)

TORCH = get_kernels("cpu", "torch")
REFERENCE = get_kernels("cpu", "reference")
NEW_TOKENS = 6
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")   # mixtral's routed experts
LAYOUTS = {
    "symmetric": Int4Layout(group_size=32, zero_points=False),
    "zero_points": Int4Layout(group_size=32, zero_points=True),
    "channel": Int4Layout(group_size=None, zero_points=False),
    "act_order": Int4Layout(group_size=16, zero_points=True, column_groups=True),
    "partial_group": Int4Layout(group_size=24, zero_points=False),   # 71 and 45 columns: a last, partial group
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are tiny: one intra-op thread runs them fastest (and alike on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=8e-3, atol=1e-2)}[dtype]


def random_int4(layout: Int4Layout, lead: tuple[int, ...], rows: int, columns: int, seed: int):
    """Random codes, scales (and zero points, column groups) in `layout`: values [*lead, rows, ceil(K/2)], scales,
    column groups [*lead, K] or None."""
    generator = torch.Generator().manual_seed(seed)
    groups = layout.groups(columns)
    values = pack_int4(torch.randint(0, 16, (*lead, rows, columns), generator=generator))
    scales = torch.rand(*lead, rows, groups, generator=generator) * 0.1 + 0.01
    if layout.zero_points:
        zeros = torch.randint(0, 16, (*lead, rows, groups), generator=generator).float()
        scales = torch.stack((scales, zeros), dim=-1)
    column_groups = None
    if layout.column_groups:   # a permutation of the contiguous grouping, as GPTQ's g_idx is
        count = lead[0] if lead else 1
        order = torch.stack([torch.randperm(columns, generator=generator) for _ in range(count)])
        column_groups = (order // layout.group_size).int().reshape(*lead, columns)   # [*lead, K]
    return values, scales, column_groups


def expert_stack(layout: Int4Layout, experts: int, hidden: int, intermediate: int, seed: int) -> dict:
    w13, w13_scale, w13_groups = random_int4(layout, (experts,), 2 * intermediate, hidden, seed)
    w2, w2_scale, w2_groups = random_int4(layout, (experts,), hidden, intermediate, seed + 1)
    return dict(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale, w13_groups=w13_groups, w2_groups=w2_groups)


def dense_experts(layout: Int4Layout, stack: dict, hidden: int, intermediate: int):
    return (dequantize_int4(layout, stack["w13"], stack["w13_scale"], hidden, stack["w13_groups"]),
            dequantize_int4(layout, stack["w2"], stack["w2_scale"], intermediate, stack["w2_groups"]))


def expert_arguments(stack: dict, layout: Int4Layout) -> tuple[tuple, dict]:
    return ((stack["w13"], stack["w13_scale"], stack["w2"], stack["w2_scale"]),
            dict(layout=layout, w13_groups=stack["w13_groups"], w2_groups=stack["w2_groups"]))


# ------------------------------------------------------------------------------------------------ quantizer

@pytest.mark.parametrize("layout", [LAYOUTS["symmetric"], LAYOUTS["zero_points"]], ids=["symmetric", "zero_points"])
def test_quantization_rounds_each_group_to_its_nearest_code(layout):
    weight = torch.randn(6, 70, generator=torch.Generator().manual_seed(0))
    weight[1] = 0.0                                                         # a row of zeros: scale 1
    weight[2, 5] = 30.0                                                     # an outlier owns its group's scale
    int4 = quantize_int4(weight.to(torch.bfloat16), layout)                 # any float dtype in
    assert int4.values.dtype == torch.uint8 and int4.values.shape == (6, 35)
    assert int4.scales.dtype == torch.float32 and tuple(int4.scales.shape) == layout.scale_shape(6, 70)
    scale = int4.scales[..., 0] if layout.zero_points else int4.scales      # [6, 3]
    assert (scale[1] == 1.0).all()
    error = (int4.dequantized(layout) - weight.to(torch.bfloat16).float()).abs()   # [6, 70]
    step = scale.repeat_interleave(32, -1)[:, :70]
    assert (error <= step * (1.0 if layout.zero_points else 0.5) * (1 + 1e-6)).all()   # half a step, or a step
    assert error[2, 5] < 1e-5 if not layout.zero_points else error[2, 5] <= step[2, 5]
    if not layout.zero_points:
        assert scale[2, 0] == pytest.approx(30.0 / 7)                      # max |w| is exactly 7 steps


# ------------------------------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_the_dequantized_linear(layout_name, dtype):
    layout = LAYOUTS[layout_name]
    values, scales, groups = random_int4(layout, (), 37, 71, seed=3)   # odd N and K
    weight = dequantize_int4(layout, values, scales, 71, groups)
    bias = torch.randn(37).to(dtype)
    for x in (torch.randn(2, 5, 71).to(dtype), torch.randn(1, 71).to(dtype)):   # several rows, and one (gemv)
        got = TORCH.int4_linear(x, values, scales, layout, bias, groups)
        want = torch.nn.functional.linear(x.float(), weight, bias.float()).to(dtype)
        assert got.dtype == dtype and got.shape == (*x.shape[:-1], 37)
        torch.testing.assert_close(got, want, **tolerance(dtype))
        torch.testing.assert_close(REFERENCE.int4_linear(x, values, scales, layout, bias, groups), want,
                                   **tolerance(dtype))


# padded all-experts form (most experts busy, <= 8 rows each): [3, 0, 1, 2]; the loop over busy experts: [10, 0, 0, 3]
@pytest.mark.parametrize("counts", [[3, 0, 1, 2], [10, 0, 0, 3]])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_int4_expert_mlp_is_the_dequantized_expert_mlp(layout_name, counts):
    layout, hidden, intermediate = LAYOUTS[layout_name], 45, 19                # odd H and I
    stack = expert_stack(layout, 4, hidden, intermediate, seed=sum(counts))
    args, keywords = expert_arguments(stack, layout)
    counts = torch.tensor(counts)
    x_sorted = torch.randn(int(counts.sum()), hidden)                         # [N, H] grouped by expert
    got = TORCH.int4_expert_mlp(x_sorted, counts, *args, **keywords)
    want = TORCH.expert_mlp(x_sorted, counts, *dense_experts(layout, stack, hidden, intermediate))
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    torch.testing.assert_close(REFERENCE.int4_expert_mlp(x_sorted, counts, *args, **keywords), want,
                               **tolerance(torch.float32))


@pytest.mark.parametrize("counts", [[0, 6, 2, 1], [0, 9, 2, 0]])             # padded form; loop over busy experts
@pytest.mark.parametrize("layout_name", ["zero_points", "act_order"])
def test_int4_masked_expert_mlp_never_reads_stale_rows(layout_name, counts):
    layout, hidden, intermediate = LAYOUTS[layout_name], 40, 24
    stack = expert_stack(layout, 4, hidden, intermediate, seed=7)
    args, keywords = expert_arguments(stack, layout)
    counts = torch.tensor(counts)
    x = torch.randn(4, 9, hidden).to(torch.bfloat16)                          # [E, M, H]
    for expert, count in enumerate(counts.tolist()):
        x[expert, count:] = float("nan")                                     # stale rows, as DeepEP leaves them
    got = TORCH.int4_masked_expert_mlp(x, counts, *args, **keywords)
    want = REFERENCE.masked_expert_mlp(x, counts, *dense_experts(layout, stack, hidden, intermediate))
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got, want, **tolerance(torch.bfloat16))
    assert not got[0].any() and not got[2, 2:].any() and got[1, :counts[1]].abs().min() > 0


def test_kernels_refuse_weights_outside_the_layout():
    layout = LAYOUTS["symmetric"]
    values, scales, _ = random_int4(layout, (), 8, 64, seed=1)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"weight must be uint8 \[..., N, 31\] \(int4 codes of 62 columns"):
        TORCH.int4_linear(torch.randn(2, 62), values, scales, layout)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \(8, 2, 2\) \(group size 32, zero points"):
        TORCH.int4_linear(x, values, scales, LAYOUTS["zero_points"])
    with pytest.raises(ValueError, match="column groups exactly with a layout that has them"):
        TORCH.int4_linear(x, values, scales, layout, None, torch.zeros(64, dtype=torch.int32))


class FloatAndInt4Source:
    """A `TensorSource` holding one float weight `dense` and one int4 weight `packed` (as a reader of an int4
    checkpoint hands it out)."""

    def __init__(self, dense: torch.Tensor, packed):
        self.dense, self.packed = dense, packed

    def read(self, name):
        return self.dense

    def read_slice(self, name, dim, start, stop):
        return self.dense[start:stop] if dim == 0 else self.dense[:, start:stop]

    def read_int4(self, name):
        return self.packed if name == "packed" else None


def test_the_format_keeps_int4_as_stored_and_quantizes_float_weights():
    layout = LAYOUTS["zero_points"]
    quant = Int4InMemory(TORCH, layout)
    dense = torch.randn(10, 96)
    stored = quantize_int4(torch.randn(10, 96), layout)
    source = FloatAndInt4Source(dense, stored)
    kept = quant.read(source, "packed")
    assert kept.values is stored.values and kept.scales is stored.scales
    assert torch.equal(quant.read(source, "dense").values, quantize_int4(dense, layout).values)
    rows = quant.read_slice(source, "dense", 0, 2, 5)                       # rows quantize on their own
    assert torch.equal(rows.values, quantize_int4(dense[2:5], layout).values)
    assert quant.fits_columns(32, 64, 96) and not quant.fits_columns(16, 64, 96)   # whole groups only
    columns = quant.read_slice(source, "packed", 1, 32, 96)
    assert torch.equal(dequantize_int4(layout, columns.values, columns.scales, 64),
                       stored.dequantized(layout)[:, 32:])
    with pytest.raises(ValueError, match=r"packed_scale must be float32 \(10, 3\)"):
        Int4InMemory(TORCH, LAYOUTS["symmetric"]).read(source, "packed")   # stored in another layout


# ---------------------------------------------------------------------------------------- expert stacks

def filled_experts(layout: Int4Layout, expert_ids: list[int], seed: int) -> ExpertWeights:
    experts = ExpertWeights(expert_ids, hidden_size=40, intermediate_size=24, quant=Int4InMemory(TORCH, layout))
    stack = expert_stack(layout, len(expert_ids), 40, 24, seed)
    with torch.no_grad():
        for name, tensor in stack.items():
            if tensor is not None:
                getattr(experts, name).copy_(tensor)
    return experts


def test_an_int4_slot_travels_with_its_scales_and_column_groups():
    """EP replication and live migration move a slot as the bytes of its tensors: codes, scales, column groups."""
    layout = LAYOUTS["act_order"]
    source, target = filled_experts(layout, [0, 1], seed=1), filled_experts(layout, [2, 3], seed=2)
    assert source.w13.shape == (2, 48, 20) and source.w13_scale.shape == (2, 48, 3, 2)
    assert source.w13_groups.shape == (2, 40) and source.w2_groups.shape == (2, 24)
    assert source.slot_bytes == 48 * 20 + 40 * 12 + 4 * (48 * 3 * 2 + 40 * 2 * 2) + 4 * (40 + 24)
    target.stage(1, expert=1, packed=source.read_slot(1))
    target.commit()
    assert target.expert_ids == [2, 1]
    for mine, theirs in zip(target.slot_tensors(), source.slot_tensors()):
        assert torch.equal(mine[1], theirs[1])
    x, counts = torch.randn(3, 40), torch.tensor([0, 3])
    assert torch.equal(target.quant.expert_mlp(False, x, counts, target.w13, target.w13_scale, target.w2,
                                               target.w2_scale, **target.column_group_arguments()),
                       source.quant.expert_mlp(False, x, counts, source.w13, source.w13_scale, source.w2,
                                               source.w2_scale, **source.column_group_arguments()))


def test_gate_and_up_of_one_expert_must_share_their_column_groups():
    layout = LAYOUTS["act_order"]
    experts = ExpertWeights([0], hidden_size=40, intermediate_size=24, quant=Int4InMemory(TORCH, layout))
    reader = type("Reader", (), {"directory": Path("ckpt")})()
    gate, up = (random_int4(layout, (), 24, 40, seed=seed) for seed in (1, 2))
    experts.fill(0, slice(0, 24), Int4Rows(*gate), "e.0.w1.weight", reader)
    assert torch.equal(experts.w13_groups[0], gate[2])
    with pytest.raises(CheckpointError, match=r"'e\.0\.w3\.weight'.*column groups \(g_idx\) differ from its expert's "
                                              r"gate projection's"):
        experts.fill(0, slice(24, 48), Int4Rows(*up), "e.0.w3.weight", reader)


def test_int4_experts_refuse_biases_and_other_activations():
    with pytest.raises(ValueError, match="--quantization int4 keeps experts whose kernels are bias-free SiLU"):
        ExpertWeights([0], hidden_size=8, intermediate_size=4, quant=Int4InMemory(TORCH), bias=True)


# ---------------------------------------------------------------------------------------------- engine

@pytest.fixture(scope="module")
def mixtral_and_twin(tiny_checkpoint_factory, tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny fp32 mixtral, its twin whose routed experts are their int4 rounding in the default layout)."""
    source = tiny_checkpoint_factory("mixtral")
    twin = tmp_path_factory.mktemp("int4") / "twin"
    copy_side_files(source, twin)
    tensors = read_all_tensors(source)
    rounded = {name: quantize_int4(t, DEFAULT_INT4_LAYOUT).dequantized(DEFAULT_INT4_LAYOUT)
               for name, t in tensors.items() if EXPERT_WEIGHT.search(name)}
    assert len(rounded) == 2 * 8 * 3 and all(not torch.equal(rounded[n], tensors[n]) for n in rounded)   # lossy
    save_file({**tensors, **rounded}, str(twin / "model.safetensors"), metadata={"format": "pt"})
    return source, twin


def test_int4_engine_gives_the_twins_tokens_with_its_experts_packed(mixtral_and_twin):
    source, twin = mixtral_and_twin
    with LLM(str(source), device="cpu", dtype="float32", quantization="int4") as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(NEW_TOKENS))]
        model = llm.core.model
        layer = model.model.layers[0]
        experts = layer.block_sparse_moe.experts
        assert layer.self_attn.q_proj.weight.dtype == torch.float32           # experts only
        num_experts, hidden, intermediate = experts.num_local_experts, experts.hidden_size, experts.intermediate_size
        assert experts.w13.dtype == torch.uint8 and experts.w13_groups is None
        packed = (num_experts * (2 * intermediate * -(-hidden // 2) + hidden * -(-intermediate // 2))   # codes
                  + 4 * num_experts * (2 * intermediate * -(-hidden // 128) + hidden * -(-intermediate // 128)))
        assert experts.resident_bytes() == packed
        assert packed < (2 * num_experts * 3 * hidden * intermediate) / 3    # under a third of bf16's bytes
    assert tokens == hf_greedy(twin, PROMPTS[:2], NEW_TOKENS)


def test_int4_experts_on_two_ep_ranks_survive_moving_experts(mixtral_and_twin):
    """EP with DP attention, redundant experts and a live rebalance: int4 slots move as their bytes, and the tokens
    stay the twin's."""
    source, twin = mixtral_and_twin
    expected = hf_greedy(twin, PROMPTS[:2], NEW_TOKENS)
    with LLM(str(source), device="cpu", dtype="float32", quantization="int4", ep=2, dp_attn=2,
             num_redundant_experts=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(NEW_TOKENS))] == expected
        moved = llm.rebalance_now()
        assert moved.ok and moved.experts_moved > 0, moved
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(NEW_TOKENS))] == expected


def test_int4_is_a_quantization_choice_of_the_cli_and_keeps_a_checkpoints_layout():
    assert engine_config_from_args(build_parser().parse_args(["--quantization", "int4"])).quantization == "int4"
    act_order = LAYOUTS["act_order"]
    assert weights_in_memory("int4", None, TORCH).layout == DEFAULT_INT4_LAYOUT
    assert weights_in_memory("int4", None, TORCH, act_order).layout == act_order
    with pytest.raises(ValueError, match="--cpu-experts with --quantization int4"):
        LLM("unused", device="cpu", quantization="int4", cpu_experts=True)
