"""An int4 release's config values and tensors are refused naming the field or tensor, before anything is unpacked
(review of issue 52, #4, #5), and unpacking int32 words makes no int32 temporaries (#7)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.int4_layout import Int4Layout
from moe_runtime.weights.quantization.awq_format import AwqFormat
from moe_runtime.weights.quantization.compressed_tensors_int4 import CompressedTensorsInt4Format
from moe_runtime.weights.quantization.gptq_format import GptqFormat
from moe_runtime.weights.quantization.int32_nibbles import unpack_words

K, N = 64, 16
GPTQ_STORED = {"qweight": torch.zeros(K // 8, N, dtype=torch.int32),
               "qzeros": torch.full((2, N // 8), 0x77777777, dtype=torch.int32),
               "scales": torch.ones(2, N, dtype=torch.float16)}
AWQ_STORED = {"qweight": torch.zeros(K, N // 8, dtype=torch.int32), "qzeros": torch.zeros(2, N // 8, dtype=torch.int32),
              "scales": torch.ones(2, N)}


@pytest.mark.parametrize("size", [0, -32, "32", 12.5, True])
def test_a_group_size_that_is_no_positive_integer_is_refused_by_field(size):
    for packing in (GptqFormat, AwqFormat):
        with pytest.raises(CheckpointError, match=r"quantization_config\.group_size"):
            packing.of({"group_size": size}, "cfg")
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        Int4Layout(size, zero_points=False)
    assert GptqFormat.of({"group_size": -1}, "cfg").layout.group_size is None   # -1: one group a row


def test_the_bits_field_is_refused_as_stored():
    with pytest.raises(CheckpointError, match=r"bits '4'"):
        GptqFormat.of({"bits": "4"}, "cfg")


@pytest.mark.parametrize("packing, stored, local, bad", [
    (GptqFormat, GPTQ_STORED, "qweight", torch.zeros(K // 8 * N, dtype=torch.int32)),
    (GptqFormat, GPTQ_STORED, "scales", torch.ones(2 * N)),
    (AwqFormat, AWQ_STORED, "qweight", torch.zeros(1, K, N // 8, dtype=torch.int32)),
    (AwqFormat, AWQ_STORED, "qzeros", torch.zeros(2 * N // 8, dtype=torch.int32))])
def test_a_tensor_of_the_wrong_rank_is_refused_by_name(packing, stored, local, bad):
    with pytest.raises(CheckpointError, match=f"'m.weight': {local} must be 2-D"):
        packing.of({"group_size": 32}, "cfg").unpack({**stored, local: bad}, "m.weight")


@pytest.mark.parametrize("shape", [[4, 64, 1], [256], [4.0, 64.0], [4, -64]])
def test_a_compressed_tensors_weight_shape_that_is_not_two_integers_is_refused(shape):
    stored = {"weight_packed": torch.zeros(4, 8, dtype=torch.int32), "weight_scale": torch.ones(4, 2),
              "weight_shape": torch.tensor(shape)}
    with pytest.raises(CheckpointError, match="'m.weight': weight_shape must be two non-negative integers"):
        CompressedTensorsInt4Format(Int4Layout(32, False)).unpack(stored, "m.weight")


@pytest.mark.parametrize("g_idx, named", [
    (torch.full((K,), 0.9), "must hold integers"),                              # truncated to group 0
    (torch.full((K,), 2 ** 32 + 1, dtype=torch.int64), "ranging 4294967297"),   # wrapped to group 1
])
def test_gptq_g_idx_is_refused_unless_integers_in_range_as_stored(g_idx, named):
    act_order = GptqFormat.of({"group_size": 32, "desc_act": True}, "cfg")
    with pytest.raises(CheckpointError, match=f"'m.weight': g_idx .*{named}"):
        act_order.unpack({**GPTQ_STORED, "g_idx": g_idx}, "m.weight")
    stored = torch.arange(K, dtype=torch.int64) % 2                              # in range, int64 as some writers store
    assert act_order.unpack({**GPTQ_STORED, "g_idx": stored}, "m.weight").column_groups.dtype == torch.int32


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any op makes, in bytes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out


@pytest.mark.parametrize("dim, positions", [(0, None), (1, (0, 2, 4, 6, 1, 3, 5, 7))])
def test_unpacking_words_makes_no_temporary_larger_than_its_codes(dim, positions):
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (16, 24), dtype=torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)            # [16, 24, 8]: nibble i, by shifts
    if positions is not None:
        nibbles = nibbles[..., [positions.index(code) for code in range(8)]]
    with _LargestOutput() as watch:
        codes = unpack_words(words, dim, positions)
    assert torch.equal(codes, nibbles.movedim(-1, dim + 1).flatten(dim, dim + 1))
    assert watch.largest <= codes.numel()   # uint8 codes: 8 bytes a word (the shifts made 32 a word, twice)
