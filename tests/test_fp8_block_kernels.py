"""FP8 block-scaled weight kernels (weights kept float8_e4m3fn with row-expanded block scales).

The torch family runs here against the naive reference (every weight dequantized at once) and the
plain formula weight.float() * scale.repeat_interleave(block_k, -1)[..., :K]. The Triton family runs
in fp8_block_triton_cases.py and fp8_activation_triton_cases.py: compiled with CUDA (collected by
test_fp8_triton_kernels.py, apart from this module so their helpers cannot replace this one's), else
in the Triton interpreter in test_kernels_triton.py's child process (the interpreter must be on
before triton is first imported).

Tolerances (outputs are O(1)): fp32 activations rtol = atol = 1e-4 (only summation order differs).
bf16 / fp16 activations: the torch family computes in fp32 on CPU and rounds the output once, as the
reference does, so the two differ by at most one ulp of the output: rtol = 8e-3 (bf16), 1e-3 (fp16).
"""
import pytest
import torch
from fp8_block_inputs import all_e4m3_codes, random_fp8_experts, random_fp8_weight, strided

import moe_runtime.kernels.chunked_weights as chunked_weights
import moe_runtime.kernels.fp8_block_weights as fp8_module
from moe_runtime.kernels import get_kernels

FAST = get_kernels("cpu", "torch")
ORACLE = get_kernels("cpu", "reference")
HIDDEN, INTERMEDIATE = 56, 52        # partial last column blocks for block_k 16 and 48


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=8e-3, atol=1e-3),
            torch.float16: dict(rtol=1e-3, atol=1e-4)}[dtype]


def plain_dequantize(values, scale, block_k):
    return values.float() * scale.repeat_interleave(block_k, -1)[..., :values.shape[-1]]


def assert_same_values(got, expected):
    """Bitwise equal, NaN where NaN, and the same sign of zero."""
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected))
    assert torch.equal(got.signbit(), expected.signbit())


# ------------------------------------------------------------------------------------------ dequantize

@pytest.mark.parametrize("chunk_bytes", [chunked_weights.CHUNK_BYTES, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_k", [16, 48, 128])
def test_dequantize_rows_is_the_plain_formula(block_k, dtype, chunk_bytes, monkeypatch):
    monkeypatch.setattr(chunked_weights, "CHUNK_BYTES", chunk_bytes)
    generator = torch.Generator().manual_seed(block_k)
    experts = random_fp8_experts(3, 100, 20, block_k, generator)             # w2 [3, 100, 20]: K < block_k
    for weight in (experts.w13, experts.w2):
        got = fp8_module.dequantize_rows(weight.values, weight.scale, block_k, dtype)
        assert got.shape == weight.values.shape and got.dtype == dtype
        assert torch.equal(got, plain_dequantize(weight.values, weight.scale, block_k).to(dtype))


@pytest.mark.parametrize("rows_per_chunk", [1, 16])
def test_every_e4m3_code_decodes_exactly(rows_per_chunk, monkeypatch):
    """NaN codes, subnormals and -0 included; with one-row chunks only the two rows holding a NaN code
    take torch's conversion, the other fourteen the CPU bit decode."""
    codes = all_e4m3_codes()                                                 # [16, 16]
    scale = torch.rand(16, 2, generator=torch.Generator().manual_seed(0)) + 0.5   # block_k 8
    monkeypatch.setattr(chunked_weights, "CHUNK_BYTES", rows_per_chunk * 16 * 4)
    assert_same_values(fp8_module.dequantize_rows(codes, scale, 8), plain_dequantize(codes, scale, 8))


def test_the_cpu_bit_decode_itself_is_exact():
    finite = all_e4m3_codes().flatten()[[c for c in range(256) if c not in (0x7F, 0xFF)]].view(2, 127)
    scale = torch.tensor([[0.75, 3.0], [2.0 ** -20, 200.0]])                 # block_k 64: 127 = 64 + 63
    assert not fp8_module.holds_nan_codes(finite) and fp8_module.bit_decode_applies(finite, scale)
    out = torch.empty(2, 127)
    fp8_module.decode_rows_into(out, finite, scale, 64, bit_decode=True)
    assert_same_values(out, plain_dequantize(finite, scale, 64))


def test_scales_too_large_for_the_bit_decode_take_the_exact_path():
    weight = random_fp8_weight(20, 40, 16, torch.Generator().manual_seed(1))
    scale = weight.scale.clone()
    scale[3, 1] = 2.0 ** 9                                                   # scale * 2^120 would overflow
    assert not fp8_module.bit_decode_applies(weight.values, scale)
    expected = plain_dequantize(weight.values, scale, 16)
    assert torch.isfinite(expected).all()
    assert torch.equal(fp8_module.dequantize_rows(weight.values, scale, 16), expected)


def test_flushed_denormals_take_the_exact_path():
    subnormals = torch.arange(1, 8, dtype=torch.uint8).view(torch.float8_e4m3fn).view(1, 7)
    scale = torch.ones(1, 1)
    flushing = torch.set_flush_denormal(True)       # False where the CPU cannot flush: then nothing is lost
    try:
        assert fp8_module.denormals_survive(torch.device("cpu")) is not flushing
        assert fp8_module.bit_decode_applies(subnormals, scale) is not flushing
        got = fp8_module.dequantize_rows(subnormals, scale, 16)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, plain_dequantize(subnormals, scale, 16)) and (got > 0).all()


# ----------------------------------------------------------------------------------------------- linear

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
@pytest.mark.parametrize("block_k", [16, 48, 128])
def test_fp8_linear_matches_the_reference(block_k, tokens, dtype):
    generator = torch.Generator().manual_seed(tokens + block_k)
    weight = random_fp8_weight(40, 100, block_k, generator)                  # N = 40: partial row block too
    x = torch.randn(tokens, 100, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype)
    for args in ((x, weight.values, weight.scale, block_k), (strided(x), weight.values, weight.scale, block_k, bias)):
        got = FAST.fp8_linear(*args)
        assert got.shape == (tokens, 40) and got.dtype == dtype
        torch.testing.assert_close(got.float(), ORACLE.fp8_linear(*args).float(), **tolerance(dtype))


def test_reference_linear_is_f_linear_on_the_plain_dequantized_weight():
    weight = random_fp8_weight(24, 40, 16, torch.Generator().manual_seed(3))
    x = torch.randn(3, 40)
    expected = torch.nn.functional.linear(x, plain_dequantize(weight.values, weight.scale, 16))
    assert torch.equal(ORACLE.fp8_linear(x, weight.values, weight.scale, 16), expected)


def test_fp8_linear_takes_leading_dims():
    weight = random_fp8_weight(24, 40, 16, torch.Generator().manual_seed(4))
    x = torch.randn(2, 3, 40)
    got = FAST.fp8_linear(x, weight.values, weight.scale, 16)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, ORACLE.fp8_linear(x.view(6, 40), weight.values, weight.scale, 16).view(2, 3, 24),
                               **tolerance(torch.float32))


def test_fp8_linear_never_holds_more_than_a_chunk_dequantized(monkeypatch):
    weight = random_fp8_weight(100, 48, 16, torch.Generator().manual_seed(5))
    x = torch.randn(4, 48)
    monkeypatch.setattr(chunked_weights, "CHUNK_BYTES", 30 * 48 * 4)              # 30 rows: 4 chunks, the last partial
    decoded_rows = []
    decode = fp8_module.decode_rows_into

    def spy(out, *args, **kwargs):
        decoded_rows.append(out.shape[0])
        return decode(out, *args, **kwargs)

    monkeypatch.setattr(fp8_module, "decode_rows_into", spy)
    got = FAST.fp8_linear(x, weight.values, weight.scale, 16)
    assert decoded_rows == [30, 30, 30, 10]
    torch.testing.assert_close(got, ORACLE.fp8_linear(x, weight.values, weight.scale, 16), **tolerance(torch.float32))


# ------------------------------------------------------------------------------------------ expert MLPs

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 0, 2, 0], [9, 1, 1, 1]])
@pytest.mark.parametrize("block_k", [16, 48])
def test_fp8_expert_mlp_matches_the_reference(block_k, counts, dtype):
    generator = torch.Generator().manual_seed(block_k + sum(counts))
    experts = random_fp8_experts(4, HIDDEN, INTERMEDIATE, block_k, generator)
    counts = torch.tensor(counts)
    x_sorted = torch.randn(int(counts.sum()), HIDDEN, generator=generator).to(dtype)
    expected = ORACLE.fp8_expert_mlp(x_sorted, counts, *experts.args())
    for x in (x_sorted, strided(x_sorted)):
        got = FAST.fp8_expert_mlp(x, counts, *experts.args())
        assert got.shape == x_sorted.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_k", [16, 48])
def test_fp8_masked_expert_mlp_zeroes_and_ignores_stale_rows(block_k, dtype):
    generator = torch.Generator().manual_seed(block_k)
    experts = random_fp8_experts(4, HIDDEN, INTERMEDIATE, block_k, generator)
    counts = torch.tensor([2, 0, 1, 4])
    x = torch.randn(4, 4, HIDDEN, generator=generator).to(dtype)
    x[0, 2:] = float("nan")                                                  # a dispatch buffer's stale rows
    x[2, 1:] = float("inf")
    got = FAST.fp8_masked_expert_mlp(x, counts, *experts.args())
    assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
    assert torch.all(got[0, 2:] == 0) and torch.all(got[1] == 0) and torch.all(got[2, 1:] == 0)
    expected = ORACLE.fp8_masked_expert_mlp(torch.nan_to_num(x), counts, *experts.args())
    torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))


def test_bad_fp8_arguments_name_the_tensor():
    experts = random_fp8_experts(2, 32, 16, 16, torch.Generator().manual_seed(6))
    w13, w13_scale, w2, w2_scale, block_k = experts.args()
    x, counts = torch.randn(3, 32), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="w13_scale"):
        FAST.fp8_expert_mlp(x, counts, w13, w13_scale[..., :1], w2, w2_scale, block_k)
    with pytest.raises(ValueError, match="w2 must be torch.float8_e4m3fn"):
        FAST.fp8_expert_mlp(x, counts, w13, w13_scale, w2.float(), w2_scale, block_k)
    with pytest.raises(ValueError, match="block_k"):
        FAST.fp8_expert_mlp(x, counts, w13, w13_scale, w2, w2_scale, 0)
    with pytest.raises(ValueError, match="counts sum to 3"):
        FAST.fp8_expert_mlp(x[:2], counts, w13, w13_scale, w2, w2_scale, block_k)
    with pytest.raises(ValueError, match="capacity"):
        FAST.fp8_masked_expert_mlp(x.view(1, 3, 32).expand(2, 3, 32), torch.tensor([4, 0]), *experts.args())
    with pytest.raises(ValueError, match="weight_scale"):
        FAST.fp8_linear(x, w2[0], w2_scale[0].t(), block_k)


# ------------------------------------------------------------------------- a layer's linear: checked at load

def test_fp8_in_memory_checks_a_weight_once_at_load_not_per_forward(monkeypatch):
    from moe_runtime.weights.quantization.fp8_in_memory import Fp8InMemory, Fp8Rows

    quant = Fp8InMemory(16, FAST)
    checks = []
    check = fp8_module.check_fp8_weight
    monkeypatch.setattr(fp8_module, "check_fp8_weight",
                        lambda *args, **kwargs: checks.append(args) or check(*args, **kwargs))
    rows = quant.quantize(torch.randn(24, 40, generator=torch.Generator().manual_seed(8)))
    assert len(checks) == 1                                                  # at load
    x = torch.randn(3, 40)
    for _ in range(3):
        got = quant.linear(x, rows.values, rows.scales)
    assert len(checks) == 1                                                  # no forward checked it again
    assert quant.linear_kernel is fp8_module.fp8_linear_prechecked
    torch.testing.assert_close(got, ORACLE.fp8_linear(x, rows.values, rows.scales, 16), **tolerance(torch.float32))
    FAST.fp8_linear(x, rows.values, rows.scales, 16)                         # the public entry point still checks
    assert len(checks) == 2
    with pytest.raises(ValueError, match="w_scale"):                         # a bad weight is refused at load, by name
        quant.checked(Fp8Rows(rows.values, rows.scales[:, :1]), "w")


def test_a_layer_decides_the_cpu_bit_decode_at_load_not_per_forward(monkeypatch):
    """Whether the bit decode suits a weight (its scales' range, NaN codes in its bytes) is asked once, when a
    Linear has loaded it; its forwards read neither the scales nor the bytes again, and give the same values."""
    from moe_runtime.layers.linear import Linear
    from moe_runtime.weights.quantization.fp8_in_memory import Fp8InMemory

    quant = Fp8InMemory(16, FAST)
    rows = quant.quantize(torch.randn(24, 40, generator=torch.Generator().manual_seed(9)))
    layer = Linear(40, 24, quant=quant)
    with torch.no_grad():
        layer.weight.copy_(rows.values)
        layer.weight_scale.copy_(rows.scales)
    layer.quant_plan = quant.plan(layer.weight, layer.weight_scale)            # what _load_quantized does
    assert layer.quant_plan is True
    x = torch.randn(3, 40)
    want = quant.linear(x, rows.values, rows.scales)                          # deciding per call, as before
    asked = []
    for name in ("holds_nan_codes", "bit_decode_applies"):
        monkeypatch.setattr(fp8_module, name, lambda *args, name=name: asked.append(name))
    assert torch.equal(layer(x), want) and asked == []
    nan_weight = rows.values.clone()
    nan_weight.view(torch.uint8)[0, 0] = 0x7F                                # a NaN code: the exact path, decided at load
    monkeypatch.undo()
    assert quant.plan(nan_weight, rows.scales) is False


def test_families_without_a_prechecked_linear_keep_their_own():
    from moe_runtime.weights.quantization.fp8_in_memory import Fp8InMemory

    assert Fp8InMemory(16, ORACLE).linear_kernel is ORACLE.fp8_linear
