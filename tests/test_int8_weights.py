"""`--quantization int8`: weights kept int8 with one fp32 scale per output row, quantized at load.

Kernels: the torch family against the naive reference (every weight dequantized at once, then the
plain op). Tolerances, outputs O(1)-O(10): fp32 rtol = atol = 1e-4 (the torch family multiplies the
scales into the output, x @ (q * s).T == (x @ q.T) * s: only fp32 rounding differs); bf16 activations
are computed in fp32 on CPU and rounded once, as the reference does: rtol 8e-3.

Engine: the oracle is transformers with the kept weights replaced by their int8 dequantization
(q * s, done in place here), so a correct loader and kernel family must give its
logits up to fp32 rounding and its greedy tokens exactly. Against transformers on the ORIGINAL fp32
weights the logits move by what int8 costs these tiny random models (max abs, prompt positions of
PROMPTS: llama 0.13, qwen3_moe 0.094, deepseek_v3 1.6, where a perturbed router flips an expert
choice; FP8 quantized at load moves them by 0.56 / - / 2.6). Greedy tokens against the original
weights: llama 1/4, qwen3_moe 4/4, deepseek_v3 1/4 sequences identical over 8 tokens (random
weights leave thin argmax margins): reported here, asserted only through the dequantized oracle.
"""
import re

import pytest
import torch
from engine_helpers import PROMPTS, greedy, runtime_prefill_logits
from tiny_checkpoints import HFOracle

import moe_runtime.kernels.chunked_weights as chunked_weights
from moe_runtime.kernels import get_kernels
from moe_runtime import LLM
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.weights.quantization.int8_in_memory import Int8InMemory, quantize_int8_rows
from moe_runtime.server.cli import build_parser, engine_config_from_args

FAST = get_kernels("cpu", "torch")
ORACLE = get_kernels("cpu", "reference")
NEW_TOKENS = 8
# the projections the runtime keeps int8 (MLA's kv_b_proj, routers, norms, embeddings, lm_head stay)
KEPT_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}
# max abs logit difference to transformers on the original weights (measured: see the module docstring)
ORIGINAL_WEIGHTS_LOGIT_BOUND = {"llama": 0.3, "qwen3_moe": 0.3, "deepseek_v3": 2.5}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are tiny: one intra-op thread runs them fastest (and alike on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=8e-3, atol=1e-3)}[dtype]


def quantized(*shape, seed: int):
    """A random weight [..., N, K] (std K^-1/2) as int8 values and per-row scales."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=generator) * shape[-1] ** -0.5
    rows = quantize_int8_rows(weight)
    return rows.values, rows.scales


def plain_dequantize(values, scales):
    return values.float() * scales.unsqueeze(-1)


# ----------------------------------------------------------------------------------------- quantizer

def test_quantization_is_symmetric_per_row_and_within_half_a_step():
    weight = torch.randn(37, 53, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0                                                          # a row of zeros
    weight[5, 7] = 40.0                                                      # an outlier owns its row's scale
    rows = quantize_int8_rows(weight.to(torch.bfloat16))                     # any float dtype in
    assert rows.values.dtype == torch.int8 and rows.scales.dtype == torch.float32
    assert rows.values.shape == (37, 53) and rows.scales.shape == (37,)
    assert int(rows.values.abs().max()) == 127 and int(rows.values.min()) >= -127
    assert rows.scales[3] == 1.0 and not rows.values[3].any()
    assert rows.scales[5] == pytest.approx(40.0 / 127)
    error = (plain_dequantize(rows.values, rows.scales) - weight.to(torch.bfloat16).float()).abs()
    assert (error <= rows.scales.unsqueeze(-1) / 2 * (1 + 1e-6)).all()


def test_kernels_refuse_weights_that_are_not_int8_rows():
    values, scales = quantized(8, 16, seed=1)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="weight must be torch.int8"):
        FAST.int8_linear(x, values.float(), scales)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \(8,\)"):
        FAST.int8_linear(x, values, scales.unsqueeze(-1))
    with pytest.raises(ValueError, match="int8_linear: x"):
        FAST.int8_linear(torch.randn(2, 15), values, scales)


# ------------------------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("chunk_bytes", [chunked_weights.CHUNK_BYTES, 1000])     # one chunk, and many partial ones
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
def test_int8_linear_is_the_dequantized_linear(tokens, dtype, chunk_bytes, monkeypatch):
    monkeypatch.setattr(chunked_weights, "CHUNK_BYTES", chunk_bytes)
    values, scales = quantized(203, 67, seed=tokens)                         # odd N and K
    bias = torch.randn(203).to(dtype)
    x = torch.randn(2, tokens, 67).to(dtype) if tokens else torch.randn(0, 67).to(dtype)
    for b in (None, bias):
        got = FAST.int8_linear(x, values, scales, b)
        want = ORACLE.int8_linear(x, values, scales, b)
        plain = torch.nn.functional.linear(x.float(), plain_dequantize(values, scales),
                                           None if b is None else b.float()).to(dtype)
        assert got.dtype == dtype and got.shape == (*x.shape[:-1], 203)
        torch.testing.assert_close(got, want, **tolerance(dtype))
        torch.testing.assert_close(got, plain, **tolerance(dtype))


def test_int8_linear_of_one_row_takes_gemv_and_agrees_with_many_rows():
    values, scales = quantized(1029, 300, seed=3)
    x = torch.randn(5, 300)
    one_by_one = torch.cat([FAST.int8_linear(x[i:i + 1], values, scales) for i in range(5)])
    torch.testing.assert_close(one_by_one, FAST.int8_linear(x, values, scales), rtol=1e-5, atol=1e-5)


def expert_stack(experts: int, hidden: int, intermediate: int, seed: int):
    w13, w13_scale = quantized(experts, 2 * intermediate, hidden, seed=seed)
    w2, w2_scale = quantized(experts, hidden, intermediate, seed=seed + 1)
    return w13, w13_scale, w2, w2_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# padded all-experts form (most experts busy, <= 8 rows each): [3, 0, 1, 5, 0], [1, 1, 1, 1, 1]; loop over
# busy experts: [12, 0, 0, 3, 0], [0, 0, 9, 0, 0]; nothing: [0, 0, 0, 0, 0]
@pytest.mark.parametrize("counts", [[3, 0, 1, 5, 0], [1, 1, 1, 1, 1], [12, 0, 0, 3, 0], [0, 0, 9, 0, 0],
                                    [0, 0, 0, 0, 0]])
def test_int8_expert_mlp_is_the_dequantized_expert_mlp(counts, dtype):
    weights = expert_stack(5, 56, 52, seed=len(counts) + sum(counts))
    counts = torch.tensor(counts)
    x_sorted = torch.randn(int(counts.sum()), 56).to(dtype)                  # [N, H] grouped by expert
    got = FAST.int8_expert_mlp(x_sorted, counts, *weights)
    assert got.dtype == dtype and got.shape == x_sorted.shape
    torch.testing.assert_close(got, ORACLE.int8_expert_mlp(x_sorted, counts, *weights), **tolerance(dtype))
    dequantized = plain_dequantize(weights[0], weights[1]), plain_dequantize(weights[2], weights[3])
    torch.testing.assert_close(got, ORACLE.expert_mlp(x_sorted, counts, *dequantized), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[0, 6, 2, 1], [0, 9, 2, 0]])             # padded form; loop over busy experts
def test_int8_masked_expert_mlp_never_reads_stale_rows(counts, dtype):
    weights = expert_stack(4, 40, 24, seed=7)
    counts = torch.tensor(counts)
    x = torch.randn(4, 9, 40).to(dtype)                                      # [E, M, H]
    for expert, count in enumerate(counts.tolist()):
        x[expert, count:] = float("nan")                                     # stale rows, as DeepEP leaves them
    got = FAST.int8_masked_expert_mlp(x, counts, *weights)
    want = ORACLE.int8_masked_expert_mlp(x, counts, *weights)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, want, **tolerance(dtype))
    assert not got[0].any() and not got[2, 2:].any()                          # rows past each count are zero
    assert got[1, :counts[1]].abs().min() > 0


def test_every_kernel_family_has_the_int8_kernels():
    for family in (FAST, ORACLE):
        assert callable(family.int8_linear) and callable(family.int8_expert_mlp)
        assert callable(family.int8_masked_expert_mlp)


def test_an_int8_expert_slot_travels_with_its_scales():
    """EP replication and live migration move a slot as the bytes of its tensors: int8 values and scales."""
    quant = Int8InMemory(FAST)
    source = ExpertWeights([0, 1], hidden_size=24, intermediate_size=10, quant=quant)
    target = ExpertWeights([2, 3], hidden_size=24, intermediate_size=10, quant=quant)
    for store, seed in ((source, 1), (target, 2)):
        w13, w13_scale, w2, w2_scale = expert_stack(2, 24, 10, seed=seed)
        for param, value in zip(store.slot_tensors(), (w13, w13_scale, w2, w2_scale)):
            param.data.copy_(value)
    assert source.w13.dtype == torch.int8 and source.w13_scale.shape == (2, 20) and source.w2_scale.shape == (2, 24)
    assert source.slot_bytes == 20 * 24 + 24 * 10 + 4 * (20 + 24)
    target.stage(1, expert=1, packed=source.read_slot(1))
    target.commit()
    assert target.expert_ids == [2, 1]
    for mine, theirs in zip(target.slot_tensors(), source.slot_tensors()):
        assert torch.equal(mine[1], theirs[1])


# --------------------------------------------------------------------------------------------- engine

def int8_dequantize_(model) -> None:
    """A transformers model turned into the oracle, in place: every kept weight replaced by q * s.

    transformers holds routed experts fused, `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj`
    [E, H, I] (output rows, then inputs, like the checkpoint's per-expert tensors): rows quantize alike.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            projection = param.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in KEPT_MODULES
            experts = param.dim() == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if name.startswith("model.layers.") and (projection or experts):
                rows = quantize_int8_rows(param)
                param.copy_(plain_dequantize(rows.values, rows.scales))


def kept_in_int8(name: str) -> bool:
    """A projection's weight, or an expert stack (routed, shared, dense MLP: `...mlp[.experts].w13` / `.w2`)."""
    return name.split(".")[-2] in KEPT_MODULES or name.endswith((".w13", ".w2"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_int8_engine_computes_the_dequantized_weights_in_a_quarter_of_the_bytes(arch, tiny_checkpoint_factory):
    checkpoint = tiny_checkpoint_factory(arch)
    with LLM(str(checkpoint), device="cpu", dtype="float32", quantization="int8") as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        logits = [runtime_prefill_logits(llm.core, prompt) for prompt in PROMPTS]
        model = llm.core.model
        params = dict(model.named_parameters())

    oracle = HFOracle(checkpoint)
    error = max(float((got - oracle.prefill_logits(p)).abs().max()) for p, got in zip(PROMPTS, logits))
    assert 0 < error < ORIGINAL_WEIGHTS_LOGIT_BOUND[arch], error   # against the original weights
    int8_dequantize_(oracle.model)
    for prompt, got in zip(PROMPTS, logits):
        torch.testing.assert_close(got, oracle.prefill_logits(prompt), rtol=0, atol=1e-4)
    assert tokens[:2] == oracle.greedy(PROMPTS[:2], NEW_TOKENS)   # (transformers' generate is the slow part)

    in_int8 = {n: p for n, p in params.items() if p.dtype == torch.int8}
    assert in_int8 and all(kept_in_int8(n) for n in in_int8), sorted(in_int8)
    layer = model.model.layers[1]
    attention_weights = ([layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.o_proj]
                         if arch == "deepseek_v3" else [layer.self_attn.q_proj, layer.self_attn.o_proj])
    assert all(linear.weight.dtype == torch.int8 for linear in attention_weights)
    stays = [model.model.embed_tokens.weight, model.model.norm.weight, layer.input_layernorm.weight]
    if arch == "deepseek_v3":
        stays += [layer.self_attn.kv_b_proj.weight, layer.mlp.gate.weight]   # absorbed by MLA decode; the router
        assert layer.mlp.shared_experts.w13.dtype == layer.mlp.experts.w2.dtype == torch.int8
        assert model.model.layers[0].mlp.w13.dtype == torch.int8             # the dense layer
    assert all(p.dtype == torch.float32 for p in stays)

    # memory: values 1/4 of fp32, plus 4 bytes of scale per row of K >= 64 inputs (at most 1/64 more)
    kept_bytes = sum(p.numel() + params[n + "_scale"].numel() * 4 for n, p in in_int8.items())
    fp32_bytes = sum(p.numel() * 4 for p in in_int8.values())
    assert 0.25 < kept_bytes / fp32_bytes <= 0.25 * (1 + 4 / 64), kept_bytes / fp32_bytes


def test_int8_is_a_quantization_choice_of_the_cli_and_of_llm():
    assert engine_config_from_args(build_parser().parse_args(["--quantization", "int8"])).quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "int3"])
    # the field, every choice (`none` too: served in --dtype) and what leaving it unset means
    refusal = ("--quantization int3 is not supported; choose one of ['none', 'fp8', 'int8', 'mxfp4', 'int4'] "
               "(or leave it unset: as the checkpoint ships)")
    with pytest.raises(ValueError, match=re.escape(refusal)):
        LLM("unused", device="cpu", quantization="int3")

