"""Experts with biases and gpt-oss's clamped SwiGLU through every torch-side expert path, against a
float64 oracle with the clamps active (expert_epilogue_reference.py), and against transformers'
GptOssExperts / GptOssTopKRouter; the Triton cases run in an interpreter child (CPU) or here (CUDA)."""
from pathlib import Path

import pytest
import torch
from triton_interpreter_child import assert_cases_pass_in_interpreter
from expert_epilogue_reference import (LIMIT, activations, biased_experts, clamped_silu_experts_f64, contiguous_f64,
                                       expert_f64)
from safetensors.torch import save_file
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS
from moe_runtime.kernels import RoutingConfig, get_kernels
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.kernels.pair_experts import pair_expert_mlp
from moe_runtime.moe.expert_kernel import expert_kernel_for
from moe_runtime.moe.expert_weights import GPT_OSS_NAMING, ExpertWeights
from moe_runtime.moe.router import Router
from moe_runtime.weights.checkpoint import CheckpointReader

E, H, I = 4, 64, 32
GPT_OSS = ExpertActivation.gpt_oss()
TOL = 1e-4


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def tiny_gpt_oss_config(**overrides) -> GptOssConfig:
    return GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        vocab_size=64, **overrides)


def test_the_activation_is_transformers_gate():
    experts = GptOssExperts(tiny_gpt_oss_config())
    gate_up = torch.randn(5, 2 * I, dtype=torch.float64) * 8.0                 # interleaved, as transformers has it
    ours = GPT_OSS.on_gate_up(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1))
    torch.testing.assert_close(ours, experts._apply_gate(gate_up), rtol=0, atol=0)
    assert (gate_up[:, 0::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()


def test_deepseek_v4_activation_is_transformers_gate():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    experts = DeepseekV4Experts(DeepseekV4Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                                 swiglu_limit=LIMIT, num_hidden_layers=1))
    gate_up = torch.randn(5, 2 * I, dtype=torch.float64) * 8.0                 # gate half, then up half
    ours = ExpertActivation.deepseek_v4(LIMIT).on_gate_up(gate_up)
    torch.testing.assert_close(ours, experts._apply_gate(gate_up), rtol=0, atol=0)
    assert (gate_up[:, :I] > LIMIT).any() and (gate_up[:, I:].abs() > LIMIT).any()


@pytest.mark.parametrize("family", ["torch", "reference"])
def test_deepseek_v4_experts_through_the_torch_families(family):
    experts = biased_experts(E, H, I)
    counts = torch.tensor([3, 0, 9, 5])
    x = activations(int(counts.sum()), H)
    assert experts.clamps_bite(x)
    got = get_kernels("cpu", family).expert_mlp(x, counts, experts.w13, experts.w2,
                                                activation=ExpertActivation.deepseek_v4(LIMIT))
    want = clamped_silu_experts_f64(x, counts, experts.w13, experts.w2)
    assert relative_error(got, want) < TOL


def test_activation_is_validated():
    with pytest.raises(ValueError, match="kind"):
        ExpertActivation("gelu")
    assert ExpertActivation().is_silu and not GPT_OSS.is_silu


@pytest.mark.parametrize("family", ["torch", "reference"])
@pytest.mark.parametrize("counts", [[3, 0, 9, 5], [1, 2, 1, 1]], ids=["loop", "padded"])
def test_contiguous_expert_mlp_with_biases_and_clamps(family, counts):
    experts = biased_experts(E, H, I)
    counts = torch.tensor(counts)
    x = activations(int(counts.sum()), H)
    assert experts.clamps_bite(x)
    got = get_kernels("cpu", family).expert_mlp(x, counts, experts.w13, experts.w2, b13=experts.b13,
                                                b2=experts.b2, activation=GPT_OSS)
    assert relative_error(got, contiguous_f64(x, counts, experts.w13, experts.w2, experts.b13, experts.b2)) < TOL


@pytest.mark.parametrize("family", ["torch", "reference"])
@pytest.mark.parametrize("counts", [[3, 0, 6, 5], [1, 2, 1, 1]], ids=["few_busy", "padded"])
def test_masked_expert_mlp_with_biases_and_clamps(family, counts):
    experts = biased_experts(E, H, I)
    counts = torch.tensor(counts)
    x = activations(E * 6, H).view(E, 6, H)
    x[0, 5] = float("nan")                                                  # a stale row past counts[0]
    got = get_kernels("cpu", family).masked_expert_mlp(x, counts, experts.w13, experts.w2, b13=experts.b13,
                                                       b2=experts.b2, activation=GPT_OSS)
    for e, count in enumerate(counts.tolist()):
        want = expert_f64(x[e, :count], experts.w13[e], experts.w2[e], experts.b13[e], experts.b2[e])
        if count:
            assert relative_error(got[e, :count], want) < TOL
        assert torch.all(got[e, count:] == 0)


def test_silu_default_is_unchanged_and_biases_apply():
    experts = biased_experts(E, H, I)
    counts = torch.tensor([2, 3, 0, 1])
    x = activations(6, H)
    got = get_kernels("cpu", "torch").expert_mlp(x, counts, experts.w13, experts.w2, b13=experts.b13, b2=experts.b2)
    want = contiguous_f64(x, counts, experts.w13, experts.w2, experts.b13, experts.b2, clamped=False)
    assert relative_error(got, want) < TOL


def test_pair_experts_with_biases_and_clamps():
    experts = biased_experts(E, H, I)
    x = activations(3, H)
    slots = torch.tensor([[0, 2], [3, 1], [2, 2]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5]])
    got = pair_expert_mlp(x, slots, weights, experts.w13, experts.w2, b13=experts.b13, b2=experts.b2,
                          activation=GPT_OSS)
    want = torch.stack([sum(float(weights[t, k]) * expert_f64(x[t:t + 1], experts.w13[s], experts.w2[s],
                                                               experts.b13[s], experts.b2[s])[0]
                            for k, s in enumerate(slots[t].tolist())) for t in range(3)])
    assert relative_error(got, want) < TOL


def write_gpt_oss_block(path: Path, experts: GptOssExperts, router: GptOssTopKRouter) -> None:
    prefix = "model.layers.0.mlp."
    tensors = {f"{prefix}experts.{name}": p.detach().clone() for name, p in experts.named_parameters()}
    tensors.update({f"{prefix}router.{name}": p.detach().clone() for name, p in router.named_parameters()})
    save_file(tensors, str(path / "model.safetensors"))


def gpt_oss_block(seed: int = 0) -> tuple[GptOssExperts, GptOssTopKRouter]:
    config = tiny_gpt_oss_config()
    torch.manual_seed(seed)
    experts, router = GptOssExperts(config), GptOssTopKRouter(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 3.0 / H ** 0.5)
        experts.gate_up_proj_bias.normal_(0, 2.0)
        experts.down_proj.normal_(0, 1.0 / I ** 0.5)
        experts.down_proj_bias.normal_(0, 1.0)
        router.weight.normal_(0, 0.5)
        router.bias.normal_(0, 0.5)
    return experts, router


def test_router_matches_gpt_oss_top_k_router():
    _, router = gpt_oss_block()
    x = activations(16, H)
    ours = Router(H, E, False, torch.float32, bias=True)
    with torch.no_grad():
        ours.weight.copy_(router.weight)
        ours.bias.copy_(router.bias)
    _, scores, indices = router(x)
    topk = get_kernels("cpu", "torch").select_experts(ours(x), RoutingConfig(top_k=2, scoring="softmax",
                                                                             renormalize=True))
    order = topk.ids.argsort(dim=-1)
    want_order = indices.argsort(dim=-1)
    assert torch.equal(topk.ids.gather(1, order), indices.gather(1, want_order))
    torch.testing.assert_close(topk.weights.gather(1, order), scores.gather(1, want_order), rtol=1e-5, atol=1e-6)


def test_experts_loaded_from_gpt_oss_stacks_match_transformers(tmp_path):
    experts, router = gpt_oss_block()
    write_gpt_oss_block(tmp_path, experts, router)
    reader = CheckpointReader.open(tmp_path)
    ours = ExpertWeights(list(range(E)), H, I, GPT_OSS_NAMING, bias=True, activation=GPT_OSS)
    assert ours.load_weights(reader, "model.layers.0.mlp.experts.") == {"w13", "w2", "b13", "b2"}
    x = activations(12, H)
    _, scores, indices = router(x)
    with torch.no_grad():
        want = experts(x, indices, scores)
    plan = get_kernels("cpu", "torch").permute_by_expert(indices, E)
    kernel = expert_kernel_for(LAYOUT_CONTIGUOUS, get_kernels("cpu", "torch"))
    out_sorted = kernel(x[plan.token_index], plan.counts, ours)
    got = get_kernels("cpu", "torch").unpermute_reduce(out_sorted, plan, scores, x.shape[0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_migration_moves_expert_biases():
    source = ExpertWeights([0, 1], H, I, bias=True, activation=GPT_OSS)
    target = ExpertWeights([2, 3], H, I, bias=True, activation=GPT_OSS)
    for module, seed in ((source, 0), (target, 1)):
        generator = torch.Generator().manual_seed(seed)
        for tensor in module.slot_tensors():
            tensor.data.copy_(torch.randn(tensor.shape, generator=generator))
    target.stage(1, 0, source.read_slot(0))
    target.commit()
    assert target.expert_ids == [2, 0]
    for ours, theirs in zip(target.slot_tensors(), source.slot_tensors()):
        assert torch.equal(ours[1], theirs[0])
    assert target.b13 is not None and target.slot_bytes == source.slot_bytes


def test_fp8_and_int8_refuse_experts_they_cannot_run():
    from moe_runtime.weights.quantization.int8_in_memory import Int8InMemory

    with pytest.raises(ValueError, match="bias-free SiLU"):
        ExpertWeights([0], H, I, quant=Int8InMemory(get_kernels("cpu", "torch")), bias=True, activation=GPT_OSS)


TRITON_CASES = [Path(__file__).with_name("expert_epilogue_triton_cases.py")]

if torch.cuda.is_available():
    pytest.importorskip("triton")
    from expert_epilogue_triton_cases import *  # noqa: F401,F403  (compiled on the GPU)
else:
    @pytest.mark.slow
    @pytest.mark.triton_interpreter_cases(*TRITON_CASES)
    def test_expert_epilogue_and_mxfp4_triton_cases_in_interpreter_child(request):
        pytest.importorskip("triton")
        assert_cases_pass_in_interpreter(request, TRITON_CASES)
