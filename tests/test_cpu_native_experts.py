"""The compiled CPU expert kernel (moe_runtime/kernels/cpu_native/) against float64 and its torch twin, and in an engine.

Segments of 1 to 20 rows cover each of its paths (a row alone, 2, 3 and 4 rows per weight load); float32
and bfloat16 weights and activations; what it does not take (biases, gpt-oss's activation) goes to the torch
kernel unchanged. The build needs a C++ compiler (.ci/run installs one): without one `native_experts()` is None
and the family serves the torch kernels, checked here with the build taken away.
"""
import pytest
import torch
import torch.nn.functional as F

from engine_helpers import PROMPTS, greedy
from moe_runtime.kernels.cpu_native import custom_ops, dense_gemv, expert_kernel
from moe_runtime.kernels.cpu_native.build import compile_errors, native_experts
from moe_runtime.kernels.cpu_native.dense_gemv import cpu_linear_rows
from moe_runtime.kernels.cpu_native.expert_kernel import (cpu_expert_mlp, cpu_fp8_expert_mlp, cpu_fp8_linear, cpu_int8_expert_mlp,
                                                          cpu_int8_linear, cpu_pair_expert_mlp)
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.kernels.expert_mlp import expert_mlp
from moe_runtime.kernels.fp8_block_weights import fp8_expert_mlp, fp8_linear
from moe_runtime.kernels.int8_weights import int8_expert_mlp, int8_linear
from moe_runtime.kernels.kernel_set import get_kernels
from moe_runtime.kernels.pair_experts import pair_expert_mlp
from moe_runtime import LLM

E, H, I = 8, 64, 48


def _case(counts: list[int], dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=generator) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=generator) * 0.1).to(dtype)
    x = torch.randn(sum(counts), H, generator=generator).to(dtype)
    return x, torch.tensor(counts, dtype=torch.int64), w13, w2


@pytest.fixture(scope="module")
def native():
    """The compiled kernel: the suite's machines have a C++ compiler (.ci/run installs one), so it must build."""
    module = native_experts()
    assert module is not None, "the CPU kernel did not build (see the log line of moe_runtime/kernels/cpu_native/build.py)"
    assert custom_ops.operators() is not None   # the operators' fake implementations: traceable
    return module


def test_without_a_build_the_cpu_family_serves_the_torch_kernels(monkeypatch):
    """A machine without a compiler: every entry of the family gives the torch kernels' results."""
    monkeypatch.setattr(expert_kernel, "native_experts", lambda: None)
    x, counts, w13, w2 = _case([2, 0, 1, 0, 0, 0, 5, 0], torch.float32, seed=4)
    assert torch.equal(cpu_expert_mlp(x, counts, w13, w2), expert_mlp(x, counts, w13, w2))
    assert get_kernels("cpu", prefer="cpu").pair_expert_mlp is pair_expert_mlp   # a captured step's experts


@pytest.mark.parametrize("counts", [[1, 0, 0, 1, 0, 0, 0, 1], [0, 2, 3, 0, 1, 0, 0, 0], [9, 0, 4, 0, 20, 1, 0, 8],
                                    [0] * E], ids=["decode-rows", "few-rows", "packed-blocks", "empty"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_native_experts_match_float64(native, counts, dtype, tolerance):
    x, counts_t, w13, w2 = _case(counts, dtype)
    want = expert_mlp(x.double(), counts_t, w13.double(), w2.double())            # [N, H]
    got = cpu_expert_mlp(x, counts_t, w13, w2)
    assert got.dtype == dtype and got.shape == want.shape
    if not want.numel():   # no busy expert: nothing computed, nothing read
        return
    scale = max(want.abs().max().item(), 1e-6)
    assert (got.double() - want).abs().max().item() <= tolerance * scale
    twin = expert_mlp(x, counts_t, w13, w2)                                       # the torch kernel, same dtype
    assert (got.double() - want).abs().max() <= (twin.double() - want).abs().max() * 4 + 1e-7 * scale


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_routed_pairs_match_float64(native, dtype, tolerance):
    """The router's layout (grouped inside the kernel): 6 tokens x top-3 over 8 experts, one expert chosen by
    five tokens (the four-row path and a row alone), a token choosing one expert twice, idle experts."""
    x, _, w13, w2 = _case([6], dtype, seed=5)                                    # x [6, H]
    slot_ids = torch.tensor([[0, 3, 5], [0, 5, 5], [0, 1, 7], [0, 3, 2], [0, 7, 3], [6, 3, 1]])
    weights = torch.rand(6, 3, generator=torch.Generator().manual_seed(5))
    want = torch.zeros(6, H, dtype=torch.float64)                                # [T, H], float64 throughout
    for token, k in [(token, k) for token in range(6) for k in range(3)]:
        expert = slot_ids[token, k].item()
        gate, up = (w13[expert].double() @ x[token].double()).chunk(2)            # [I] each
        want[token] += weights[token, k].double() * (w2[expert].double() @ (F.silu(gate) * up))
    got = cpu_pair_expert_mlp(x, slot_ids, weights, w13, w2)
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= tolerance * scale
    twin = pair_expert_mlp(x, slot_ids, weights, w13, w2)                        # the torch kernel, same dtype
    assert (got.double() - want).abs().max() <= (twin.double() - want).abs().max() * 4 + 1e-7 * scale


def test_routed_pairs_refuse_a_slot_outside_the_stack(native):
    x, _, w13, w2 = _case([2], torch.float32)
    with pytest.raises(RuntimeError, match="slot 8 is not one of the 8 experts"):
        cpu_pair_expert_mlp(x, torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2), w13, w2)


def test_float32_activations_with_bfloat16_weights_widen_once(native):
    x, counts, w13, w2 = _case([3, 0, 1, 0, 0, 9, 0, 0], torch.bfloat16, seed=1)
    x = x.float()
    want = expert_mlp(x.double(), counts, w13.double(), w2.double())
    got = native.silu_expert_mlp(x, counts, w13, w2)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def _int8_rows(w: torch.Tensor):
    """Per-row symmetric int8 codes and float32 scales of `w` [..., N, K]."""
    scale = w.abs().amax(dim=-1).clamp(min=1e-8) / 127
    return torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8), scale.float()


@pytest.mark.parametrize("counts", [[1, 0, 0, 1, 0, 0, 0, 1], [9, 0, 4, 0, 20, 1, 0, 8]], ids=["decode", "prefill"])
def test_int8_experts_match_float64_of_their_dequantized_weights(native, counts):
    x, counts_t, w13, w2 = _case(counts, torch.float32, seed=3)
    (q13, s13), (q2, s2) = _int8_rows(w13), _int8_rows(w2)
    want = expert_mlp(x.double(), counts_t, (q13.double() * s13.double()[..., None]),
                      (q2.double() * s2.double()[..., None]))
    got = cpu_int8_expert_mlp(x, counts_t, q13, s13, q2, s2)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, int8_expert_mlp(x, counts_t, q13, s13, q2, s2), rtol=1e-4, atol=1e-5)   # the twin


def _traced(function):
    """`function` traced by dynamo with fullgraph=True (a graph break fails) and run without generated code."""
    return torch.compile(function, backend="eager", fullgraph=True)


@pytest.mark.parametrize("rows,traced", [(1, False), (5, False), (16, False), (17, False), (1, True), (16, True)],
                         ids=["1-row", "5-rows", "16-rows", "17-rows-torch", "1-row-traced", "16-rows-traced"])
def test_int8_linear_at_decode_rows_matches_float64(native, rows, traced):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 40, generator=generator)                       # [..., K]
    q, scale = _int8_rows(torch.randn(24, 40, generator=generator))          # [N, K]
    bias = torch.randn(24, generator=generator)
    want = x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()
    got = (_traced(cpu_int8_linear) if traced else cpu_int8_linear)(x, q, scale, bias)
    assert got.shape == (1, rows, 24) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, int8_linear(x, q, scale, bias), rtol=1e-4, atol=1e-5)


SUBNORMAL_CODES = torch.tensor([0x01, 0x05, 0x07, 0x83, 0x86], dtype=torch.uint8)   # e4m3fn with exponent 0


def _fp8_blocks(w: torch.Tensor, block_k: int):
    """FP8 e4m3fn codes of `w` [..., N, K] with one float32 scale per row and block_k columns (row-expanded), a few
    codes set to subnormals (their decode is the part a flushed denormal would lose)."""
    blocks = -(-w.shape[-1] // block_k)
    padded = F.pad(w, (0, blocks * block_k - w.shape[-1])).unflatten(-1, (blocks, block_k))   # [..., N, Kb, bk]
    scale = (padded.abs().amax(dim=-1).clamp(min=1e-8) / 448).float()                        # [..., N, Kb]
    codes = (padded / scale[..., None]).flatten(-2)[..., : w.shape[-1]].to(torch.float8_e4m3fn)
    every_seventh = codes.view(torch.uint8).view(-1)[::7]                                      # a view of the codes
    every_seventh.copy_(SUBNORMAL_CODES.repeat(every_seventh.numel())[: every_seventh.numel()])
    return codes, scale


def _fp8_dequantized(codes: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:   # float64
    return codes.double() * scale.double().repeat_interleave(block_k, dim=-1)[..., : codes.shape[-1]]


@pytest.mark.parametrize("block_k", [16, 24], ids=["aligned-blocks", "blocks-with-scalar-tails"])
@pytest.mark.parametrize("counts", [[1, 0, 0, 1, 0, 0, 0, 1], [9, 0, 4, 0, 20, 1, 0, 8]], ids=["decode", "prefill"])
def test_fp8_experts_match_float64_of_their_dequantized_weights(native, counts, block_k):
    """Block scales per 16 / 24 columns (48 = I is two 24-blocks, 64 = H two full and one partial), subnormal codes
    among the weights, float32 and bfloat16 rows."""
    x, counts_t, w13, w2 = _case(counts, torch.float32, seed=4)
    (q13, s13), (q2, s2) = _fp8_blocks(w13, block_k), _fp8_blocks(w2, block_k)
    want = expert_mlp(x.double(), counts_t, _fp8_dequantized(q13, s13, block_k), _fp8_dequantized(q2, s2, block_k))
    got = cpu_fp8_expert_mlp(x, counts_t, q13, s13, q2, s2, block_k)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, fp8_expert_mlp(x, counts_t, q13, s13, q2, s2, block_k), rtol=1e-4, atol=1e-5)
    rows16 = cpu_fp8_expert_mlp(x.bfloat16(), counts_t, q13, s13, q2, s2, block_k)
    assert rows16.dtype == torch.bfloat16 and torch.allclose(rows16.double(), want, rtol=2e-2, atol=2e-2)


def test_fp8_subnormal_codes_survive_a_thread_that_flushes_denormals(native):
    """torch.set_flush_denormal(True) on the calling thread: the kernel's threads keep denormals while it runs, so
    the subnormal codes still decode (their share of the result is checked alone: weights of only those codes)."""
    codes = SUBNORMAL_CODES.repeat(4 * 40 // 5 + 1)[: 4 * 40].view(torch.float8_e4m3fn).view(4, 40)   # [N, K]
    scale = torch.full((4, 1), 3.0)
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    want = x.double() @ _fp8_dequantized(codes, scale, 40).T
    assert want.abs().max() > 0
    flushing = torch.set_flush_denormal(True)
    try:
        got = cpu_fp8_linear(x, codes, scale, 40)
    finally:
        torch.set_flush_denormal(False)
    assert flushing and torch.allclose(got.double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("rows,traced", [(1, False), (7, False), (17, False), (1, True), (7, True)],
                         ids=["1-row", "7-rows", "17-rows-torch", "1-row-traced", "7-rows-traced"])
def test_fp8_linear_at_decode_rows_matches_float64(native, rows, traced):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 40, generator=generator)                        # [..., K]
    q, scale = _fp8_blocks(torch.randn(24, 40, generator=generator), 16)      # [N, K], [N, 3]
    bias = torch.randn(24, generator=generator)
    want = x.double() @ _fp8_dequantized(q, scale, 16).T + bias.double()
    got = (_traced(cpu_fp8_linear) if traced else cpu_fp8_linear)(x, q, scale, 16, bias)
    assert got.shape == (1, rows, 24) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, fp8_linear(x, q, scale, 16, bias), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_quantized_routed_pairs_as_a_traced_operator_match_float64(native, weights):
    """`moe_cpu::routed_expert_mlp` with int8 / FP8 weights and their scales, traced with fullgraph=True: one
    operator in the graph (its fake implementation gave dynamo the shape), the kernel's result at run time."""
    x, _, w13, w2 = _case([5], torch.float32, seed=6)                            # x [5, H]
    quantize = _int8_rows if weights == "int8" else lambda w: _fp8_blocks(w, 16)
    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    block_k = 0 if weights == "int8" else 16
    slot_ids = torch.tensor([[0, 3], [3, 5], [0, 7], [1, 3], [6, 6]])
    pair_weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(6))
    graphs = []

    def count_graphs(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    step = torch.compile(lambda *args: torch.ops.moe_cpu.routed_expert_mlp(*args) * 2, backend=count_graphs,
                         fullgraph=True)
    got = step(x, slot_ids, pair_weights, q13, q2, s13, s2, block_k) / 2                  # [T, H]
    dq13, dq2 = ((q13.double() * s13.double()[..., None], q2.double() * s2.double()[..., None]) if weights == "int8"
                 else (_fp8_dequantized(q13, s13, 16), _fp8_dequantized(q2, s2, 16)))
    want = pair_expert_mlp(x.double(), slot_ids, pair_weights.double(), dq13, dq2)
    assert got.shape == (5, H) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    called = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1 and torch.ops.moe_cpu.routed_expert_mlp in called


def test_the_operators_fake_implementations_give_the_output_shapes(native):
    """Traced with fake tensors (no data, no kernel run): the shapes and dtypes a captured step plans with."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 40, dtype=torch.bfloat16)
        assert torch.ops.moe_cpu.rows_linear(x, torch.empty(24, 40, dtype=torch.int8), torch.empty(24)).shape == (3, 24)
        fp8 = torch.ops.moe_cpu.rows_linear(x, torch.empty(24, 40, dtype=torch.float8_e4m3fn), torch.empty(24, 3), 16)
        int4 = torch.ops.moe_cpu.int4_rows_linear(x, torch.empty(24, 20, dtype=torch.uint8), torch.empty(24, 5), 8)
        routed = torch.ops.moe_cpu.routed_expert_mlp(x, torch.empty(3, 2, dtype=torch.int64), torch.empty(3, 2),
                                                     torch.empty(E, 2 * I, 40), torch.empty(E, 40, I))
    assert fp8.shape == int4.shape == (3, 24) and fp8.dtype == int4.dtype == torch.bfloat16
    assert routed.shape == (3, 40) and routed.dtype == torch.bfloat16


def test_fp8_scales_of_the_wrong_shape_are_refused_by_name(native):
    x, counts, w13, w2 = _case([1, 0, 0, 0, 0, 0, 0, 1], torch.float32)
    (q13, s13), (q2, s2) = _fp8_blocks(w13, 16), _fp8_blocks(w2, 16)
    with pytest.raises(ValueError, match="w13_scale must be float32"):
        cpu_fp8_expert_mlp(x, counts, q13, s13[..., :1].contiguous(), q2, s2, 16)
    with pytest.raises(RuntimeError, match="expert_mlp w2: float32 scales"):   # the kernel's own check
        native.silu_expert_mlp(x, counts, q13, q2, s13, s2[..., :1].contiguous(), 16)
    with pytest.raises(RuntimeError, match="block_k > 0 exactly with FP8"):
        native.silu_expert_mlp(x, counts, q13, q2, s13, s2, 0)


def test_the_avx512_path_compiles():
    """The 16-lane path runs only where the CPU has AVX-512 (a build there takes it with -march=native); here it is
    compiled for such a CPU without running, so it cannot rot unseen."""
    assert compile_errors("x86-64-v4") == ""


def test_what_the_native_kernel_does_not_take_goes_to_the_torch_kernel():
    x, counts, w13, w2 = _case([2, 0, 1, 0, 0, 0, 5, 0], torch.float32, seed=2)
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    clamped = ExpertActivation.gpt_oss()
    slot_ids, weights = torch.tensor([[0, 6], [2, 6]]), torch.ones(2, 2)
    assert torch.equal(cpu_pair_expert_mlp(x[:2], slot_ids, weights, w13, w2, b13=b13, b2=b2, activation=clamped),
                       pair_expert_mlp(x[:2], slot_ids, weights, w13, w2, b13=b13, b2=b2, activation=clamped))
    assert torch.equal(cpu_expert_mlp(x, counts, w13, w2, b13=b13, b2=b2),
                       expert_mlp(x, counts, w13, w2, b13=b13, b2=b2))
    assert torch.equal(cpu_expert_mlp(x, counts, w13, w2, activation=clamped),
                       expert_mlp(x, counts, w13, w2, activation=clamped))


def test_counts_that_do_not_cover_the_rows_are_refused():
    x, counts, w13, w2 = _case([2, 0, 1, 0, 0, 0, 5, 0], torch.float32)
    with pytest.raises(Exception, match="counts|rows"):
        cpu_expert_mlp(x[:-1], counts, w13, w2)


def test_engine_with_the_cpu_family_gives_transformers_greedy_tokens(tiny_checkpoint_factory, greedy_oracle,
                                                                     monkeypatch):
    """Routed experts and (the size rule lowered to the tiny model's weights) every projection compiled."""
    monkeypatch.setattr(dense_gemv, "COMPILED_GEMV_MIN_WEIGHT", 0)
    assert get_kernels("cpu", prefer="cpu").expert_mlp is cpu_expert_mlp
    assert get_kernels("cpu", prefer="cpu").linear_rows is cpu_linear_rows
    path = tiny_checkpoint_factory("qwen3_moe")
    with LLM(str(path), device="cpu", dtype="float32", kernels="cpu") as llm:
        outputs = llm.generate(PROMPTS[:3], greedy(12))
    assert [out.token_ids for out in outputs] == greedy_oracle("qwen3_moe", PROMPTS[:3], 12)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_engine_with_the_cpu_family_gives_the_torch_familys_tokens(native, tiny_checkpoint_factory,
                                                                            monkeypatch, quantization):
    """--quantization int8 / fp8: the compiled kernels (experts and decode projections) against the torch ones."""
    path = tiny_checkpoint_factory("qwen3_moe")
    calls = []
    monkeypatch.setattr(expert_kernel, "native_experts", lambda: calls.append(1) or native)
    tokens = {}
    for family in ("torch", "cpu"):
        with LLM(str(path), device="cpu", dtype="float32", quantization=quantization, kernels=family) as llm:
            tokens[family] = [out.token_ids for out in llm.generate(PROMPTS[:3], greedy(12))]
    assert calls, "the cpu family never took its compiled kernels"
    assert tokens["cpu"] == tokens["torch"]


def test_captured_step_with_the_cpu_family_calls_the_compiled_experts(native, tiny_checkpoint_factory,
                                                                     greedy_oracle, monkeypatch):
    """--enable-torch-compile --kernels cpu: the routed experts of every captured decode step are the compiled
    kernel's operator, as are its projections (the size rule lowered to the tiny model's weights; operator calls
    counted by the profiler: eager steps call the kernels without the dispatcher), and the greedy tokens stay
    transformers'."""
    monkeypatch.setattr(dense_gemv, "COMPILED_GEMV_MIN_WEIGHT", 0)
    path = tiny_checkpoint_factory("qwen3_moe")
    with LLM(str(path), device="cpu", dtype="float32", kernels="cpu", enable_torch_compile=True,
             torch_compile_backend="eager") as llm:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            outputs = llm.generate(PROMPTS[:3], greedy(12))
        stats = llm.core.runner.capture.stats
        num_moe_layers = llm.core.executor.placement.num_layers
    assert [out.token_ids for out in outputs] == greedy_oracle("qwen3_moe", PROMPTS[:3], 12)
    assert stats.disabled_reason is None and stats.captured_steps == 11
    calls = {name: sum(event.name == f"moe_cpu::{name}" for event in profile.events())
             for name in ("routed_expert_mlp", "rows_linear")}
    assert calls["routed_expert_mlp"] >= 11 * num_moe_layers     # and the calls traced with fake tensors
    assert calls["rows_linear"] >= 11 * (4 * num_moe_layers + 1)   # q, k, v, o per layer and the LM head
