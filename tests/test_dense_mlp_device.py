"""A dense MLP is one expert. In the compute dtype it runs as two matmuls on the input's device and hands no
kernel an expert count (whose size the grouped kernel would read off the device); kept quantized it runs
through its format's expert kernel, with the count on the input's device (a Triton kernel on CUDA cannot
read a CPU tensor). The meta device stands in for CUDA here."""
import torch

from moe_runtime.kernels.batch_invariant import BATCH_INVARIANT
from moe_runtime.moe.dense_mlp import DenseMLP
from moe_runtime.moe.expert_weights import ExpertWeights


class RecordingKernels:
    """Records where expert_mlp's inputs live and returns an output of the right shape. Named as a
    `KernelSet` is: a layer picks its path by the family's name (--deterministic's batch_invariant)."""

    def __init__(self, name: str = "recording"):
        self.name = name
        self.devices: list[tuple[torch.device, torch.device]] = []

    def expert_mlp(self, x, counts, w13, w2):  # x [T, H], counts [E]
        self.devices.append((x.device, counts.device))
        return torch.empty_like(x)

    def fp8_expert_mlp(self, x, counts, w13, w13_scale, w2, w2_scale, block_k):
        return self.expert_mlp(x, counts, w13, w2)


class RecordingQuantization:
    """A kept-quantized format's expert kernel, recording where its inputs live."""

    def __init__(self):
        self.devices: list[tuple[torch.device, torch.device]] = []

    def expert_mlp(self, masked, x, counts, w13, w13_scale, w2, w2_scale):  # x [T, H], counts [E]
        self.devices.append((x.device, counts.device))
        return torch.empty_like(x)


def test_a_dense_mlp_in_the_compute_dtype_runs_two_matmuls_on_the_input_device():
    kernels = RecordingKernels()
    mlp = DenseMLP(hidden_size=8, intermediate_size=16, kernels=kernels, device="meta")
    out = mlp(torch.empty(3, 8, device="meta"))  # [T, H]
    assert out.shape == (3, 8) and out.device == torch.device("meta")
    assert kernels.devices == []                  # no expert kernel, no count to read


def test_a_deterministic_dense_mlp_runs_the_family_s_fixed_order_expert_kernel_on_the_input_device():
    """--deterministic: plain matmuls take a row-count-dependent BLAS path, so the one expert goes through the
    batch-invariant family's expert kernel, its count on the input's device."""
    kernels = RecordingKernels(name=BATCH_INVARIANT)
    mlp = DenseMLP(hidden_size=8, intermediate_size=16, kernels=kernels, device="meta")
    mlp(torch.empty(3, 8, device="meta"))  # [T, H]
    assert kernels.devices == [(torch.device("meta"), torch.device("meta"))]


def test_a_kept_quantized_dense_mlp_builds_its_expert_count_on_the_input_device():
    mlp = DenseMLP(hidden_size=8, intermediate_size=16, kernels=RecordingKernels(), device="meta")
    mlp.quant = RecordingQuantization()
    mlp(torch.empty(3, 8, device="meta"))  # [T, H]
    assert mlp.quant.devices == [(torch.device("meta"), torch.device("meta"))]


def test_a_dense_mlp_is_expert_weights_with_one_local_expert():
    mlp = DenseMLP(hidden_size=8, intermediate_size=16, kernels=RecordingKernels(), device="meta", tp_size=2, tp_rank=1)
    assert isinstance(mlp, ExpertWeights) and mlp.expert_ids == [0]
    assert mlp.w13.shape == (1, 2 * 8, 8) and mlp.w2.shape == (1, 8, 8)  # [1, 2I/tp, H], [1, H, I/tp]
