"""The compiled CPU kernels with int4 weights kept packed (moe_runtime/kernels/cpu_native/int4_dots.h) against the
dequantized weights (`dequantize_int4`, the layout's exact rule) in float64, and their fallbacks.

Shapes that reach every path of the dots: H = 200 (groups of 32: six whole and one of 8; of 128: one whole and one
of 72; one group: 200 columns, 8 past the last 16-column step) and I = 85 (odd: a padded last byte; 5 columns past
the last 8 taken one at a time). Segments of 1 to 4 rows (decode, each row count a path of its own) and of 9 and
20 rows (prefill), 7 experts with idle ones. Act order's column groups and group sizes that are not a multiple of
8 take the torch kernel, checked with the compiled one made to fail if called.
"""
import re
from dataclasses import dataclass

import pytest
import torch
from engine_helpers import PROMPTS, greedy
from safetensors.torch import save_file
from tiny_checkpoints import hf_greedy

from moe_runtime import LLM
from moe_runtime.kernels.cpu_native import build, expert_kernel
from moe_runtime.kernels.cpu_native.build import native_experts
from moe_runtime.kernels.cpu_native.expert_kernel import (cpu_int4_expert_mlp, cpu_int4_linear,
                                                          cpu_int4_masked_expert_mlp, native_int4_suits)
from moe_runtime.kernels.expert_mlp import check_masked_counts, check_sorted_counts, expert_mlp
from moe_runtime.kernels.int4_layout import Int4Layout, dequantize_int4, pack_int4
from moe_runtime.kernels.int4_weights import int4_expert_mlp, int4_linear, int4_masked_expert_mlp
from moe_runtime.kernels.kernel_set import get_kernels
from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors
from moe_runtime.weights.quantization.int4_in_memory import DEFAULT_INT4_LAYOUT, quantize_int4

E, H, I = 7, 200, 85
MIXTRAL_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")   # the routed experts' weights
TOLERANCE = 1e-5   # of the largest output: float32 summation order over 200 columns, a few ulps

LAYOUTS = {"sym-g32": Int4Layout(32, False), "zp-g128": Int4Layout(128, True), "sym-channel": Int4Layout(None, False),
           "zp-channel": Int4Layout(None, True)}
COUNTS = {"decode": [1, 0, 2, 3, 0, 4, 1], "prefill": [9, 0, 20, 0, 0, 1, 6]}


@dataclass(frozen=True)
class Int4Experts:
    """A random int4 expert stack in the layout and its dequantized float32 weights."""

    layout: Int4Layout
    w13: torch.Tensor          # uint8 [E, 2I, ceil(H / 2)]
    w13_scale: torch.Tensor    # float32 [E, 2I, G(, 2)]
    w2: torch.Tensor           # uint8 [E, H, ceil(I / 2)]
    w2_scale: torch.Tensor     # float32 [E, H, G(, 2)]
    w13_groups: torch.Tensor | None = None   # int32 [E, H] (act order)
    w2_groups: torch.Tensor | None = None    # int32 [E, I]

    def weights(self) -> tuple[torch.Tensor, ...]:
        return self.w13, self.w13_scale, self.w2, self.w2_scale

    def groups(self) -> dict:
        return {"layout": self.layout, "w13_groups": self.w13_groups, "w2_groups": self.w2_groups}

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:   # float32 [E, 2I, H], [E, H, I]
        return (dequantize_int4(self.layout, self.w13, self.w13_scale, H, self.w13_groups),
                dequantize_int4(self.layout, self.w2, self.w2_scale, I, self.w2_groups))


def _weight(layout: Int4Layout, rows: int, columns: int, generator: torch.Generator):
    codes = torch.randint(0, 16, (E, rows, columns), generator=generator)
    groups = layout.groups(columns)
    scale = torch.rand(E, rows, groups, generator=generator) * 0.04 + 0.01          # [E, N, G]
    if layout.zero_points:
        zero = torch.randint(0, 16, (E, rows, groups), generator=generator).float()
        scale = torch.stack((scale, zero), dim=-1)                                   # [E, N, G, 2]
    return pack_int4(codes), scale


def _experts(layout: Int4Layout, seed: int = 0) -> Int4Experts:
    generator = torch.Generator().manual_seed(seed)
    w13, w13_scale = _weight(layout, 2 * I, H, generator)
    w2, w2_scale = _weight(layout, H, I, generator)
    if not layout.column_groups:
        return Int4Experts(layout, w13, w13_scale, w2, w2_scale)
    w13_groups = torch.stack([torch.randperm(H, generator=generator) % layout.groups(H) for _ in range(E)])
    w2_groups = torch.stack([torch.randperm(I, generator=generator) % layout.groups(I) for _ in range(E)])
    return Int4Experts(layout, w13, w13_scale, w2, w2_scale, w13_groups.int(), w2_groups.int())


@pytest.fixture(scope="module")
def native():
    module = native_experts()
    assert module is not None, "the CPU kernel did not build (see the log line of kernels/cpu_native/build.py)"
    return module


@pytest.fixture(scope="module")
def stacks() -> dict[str, Int4Experts]:
    return {name: _experts(layout, seed) for seed, (name, layout) in enumerate(LAYOUTS.items())}


def _assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    assert got.shape == want.shape
    scale = max(want.abs().max().item(), 1e-6)
    error = (got.double() - want).abs().max().item()
    assert error <= tolerance * scale, f"max error {error:.3g} against outputs up to {scale:.3g}"


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_native_int4_experts_match_the_dequantized_weights(native, stacks, layout, counts):
    experts = stacks[layout]
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(len(counts)))
    counts_t = torch.tensor(counts)
    w13, w2 = experts.dequantized()
    want = expert_mlp(x.double(), counts_t, w13.double(), w2.double())                    # [N, H]
    got = cpu_int4_expert_mlp(x, counts_t, *experts.weights(), layout=experts.layout)
    assert got.dtype == torch.float32
    _assert_close(got, want)
    dense = expert_mlp(x, counts_t, w13, w2)   # float32 on the dequantized weights: the same order of error
    assert (got.double() - want).abs().max() <= 8 * (dense.double() - want).abs().max() + 1e-7 * want.abs().max()


def test_native_int4_experts_take_bfloat16_rows(native, stacks):
    experts = stacks["zp-g128"]
    counts = torch.tensor(COUNTS["decode"])
    x = torch.randn(int(counts.sum()), H, generator=torch.Generator().manual_seed(3)).bfloat16()
    w13, w2 = experts.dequantized()
    got = cpu_int4_expert_mlp(x, counts, *experts.weights(), layout=experts.layout)
    assert got.dtype == torch.bfloat16
    _assert_close(got, expert_mlp(x.double(), counts, w13.double(), w2.double()), tolerance=1e-2)


@pytest.mark.parametrize("layout", ["sym-g32", "zp-channel"])
def test_native_int4_masked_experts_match_and_never_read_stale_rows(native, stacks, layout):
    """The masked layout [E, M, H]: rows past counts[e] hold NaN, which must not reach any output."""
    experts = stacks[layout]
    counts = torch.tensor([2, 0, 5, 1, 0, 3, 4])
    x = torch.full((E, 5, H), float("nan"))
    for e, count in enumerate(counts.tolist()):
        x[e, :count] = torch.randn(count, H, generator=torch.Generator().manual_seed(e))
    w13, w2 = experts.dequantized()
    got = cpu_int4_masked_expert_mlp(x, counts, *experts.weights(), layout=experts.layout)
    want = torch.zeros(E, 5, H, dtype=torch.float64)
    for e, count in enumerate(counts.tolist()):
        want[e, :count] = expert_mlp(x[e, :count].double(), torch.tensor([count]), w13[e:e + 1].double(),
                                     w2[e:e + 1].double())
    _assert_close(got, want)
    assert torch.equal(got[1], torch.zeros(5, H)) and torch.equal(got[0, 2:], torch.zeros(3, H))


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_native_int4_linear_matches_the_dequantized_weight(native, stacks, rows):
    experts = stacks["zp-g128"]
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(2 * I, generator=torch.Generator().manual_seed(9))
    weight = dequantize_int4(experts.layout, experts.w13[0], experts.w13_scale[0], H)     # [2I, H]
    got = cpu_int4_linear(x, experts.w13[0], experts.w13_scale[0], experts.layout, bias)
    _assert_close(got, x.double() @ weight.double().T + bias.double())


class _MustNotRun:
    """The compiled module with its int4 entries made to fail: what takes the torch kernel never calls them."""

    def __getattr__(self, name):
        raise AssertionError(f"the compiled kernel's {name} was called where the torch kernel should serve")


@pytest.mark.parametrize("layout", [Int4Layout(32, True, column_groups=True), Int4Layout(4, False)],
                         ids=["act-order", "group-4"])
def test_layouts_the_native_kernel_does_not_take_use_the_torch_kernel(monkeypatch, layout):
    assert not native_int4_suits(layout)
    experts = _experts(layout, seed=7)
    monkeypatch.setattr(expert_kernel, "native_experts", _MustNotRun)
    counts = torch.tensor(COUNTS["decode"])
    x = torch.randn(int(counts.sum()), H, generator=torch.Generator().manual_seed(8))
    got = cpu_int4_expert_mlp(x, counts, *experts.weights(), **experts.groups())
    assert torch.equal(got, int4_expert_mlp(x, counts, *experts.weights(), **experts.groups()))
    masked = x[:E].reshape(E, 1, H)                                                      # [E, 1, H]
    ones = torch.ones(E, dtype=torch.int64)
    assert torch.equal(cpu_int4_masked_expert_mlp(masked, ones, *experts.weights(), **experts.groups()),
                       int4_masked_expert_mlp(masked, ones, *experts.weights(), **experts.groups()))
    row_groups = None if experts.w13_groups is None else experts.w13_groups[0]                # [H] or None
    assert torch.equal(cpu_int4_linear(x[:2], experts.w13[0], experts.w13_scale[0], layout, column_groups=row_groups),
                       int4_linear(x[:2], experts.w13[0], experts.w13_scale[0], layout, column_groups=row_groups))


def test_the_kernel_refuses_group_sizes_it_cannot_load(native, stacks):
    experts = stacks["sym-g32"]
    with pytest.raises(RuntimeError, match="multiple of 8"):
        native.silu_int4_expert_mlp(torch.zeros(1, H), torch.tensor([1, 0, 0, 0, 0, 0, 0]), *experts.weights(), 12)


class _Recording:
    """The compiled module, recording which of its entries are called."""

    def __init__(self, module):
        self.module, self.called = module, set()

    def __getattr__(self, name):
        self.called.add(name)
        return getattr(self.module, name)


def test_int4_engine_with_the_cpu_family_gives_the_twins_tokens(native, tiny_checkpoint_factory, tmp_path,
                                                                 monkeypatch):
    """--quantization int4 --kernels cpu on a tiny mixtral: the routed experts run the compiled int4 kernel and the
    greedy tokens are transformers' on its twin, whose experts are their int4 rounding (the load's own layout)."""
    source = tiny_checkpoint_factory("mixtral")
    copy_side_files(source, tmp_path)
    tensors = read_all_tensors(source)
    rounded = {name: quantize_int4(t, DEFAULT_INT4_LAYOUT).dequantized(DEFAULT_INT4_LAYOUT)
               for name, t in tensors.items() if MIXTRAL_EXPERT.search(name)}
    save_file({**tensors, **rounded}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    recording = _Recording(native)
    monkeypatch.setattr(expert_kernel, "native_experts", lambda: recording)
    with LLM(str(source), device="cpu", dtype="float32", quantization="int4", kernels="cpu") as llm:
        tokens = [out.token_ids for out in llm.generate(PROMPTS[:2], greedy(6))]
    assert recording.called & {"silu_int4_expert_mlp", "silu_int4_masked_expert_mlp"}, recording.called
    assert tokens == hf_greedy(tmp_path, PROMPTS[:2], 6)


def test_the_cpu_family_hands_out_the_int4_kernels():
    kernels = get_kernels("cpu", prefer="cpu")
    assert kernels.int4_expert_mlp is cpu_int4_expert_mlp
    assert kernels.int4_masked_expert_mlp is cpu_int4_masked_expert_mlp
    assert kernels.int4_linear is cpu_int4_linear


def test_the_build_hashes_every_header_the_kernel_includes():
    """A header the build did not copy and hash would leave a stale cached kernel after it changes."""
    sources = (build.SOURCE, *build.HEADERS)
    included = {name for path in sources for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included == {header.name for header in build.HEADERS}


def test_negative_counts_are_refused_before_any_row_is_touched(native, stacks):
    """Counts [6, -4, 2, 0, ...] sum to a 4-row x: accepted on their sum alone, expert 0 read and wrote 6 rows (review
    of issue 52, #3). The compiled ops, float and int4, and the python checks every format's kernels call refuse."""
    experts = stacks["sym-g32"]
    counts = torch.tensor([6, -4, 2, 0, 0, 0, 0])
    x = torch.zeros(4, H)
    with pytest.raises(RuntimeError, match=r"counts\[1\] = -4 is negative"):
        native.silu_int4_expert_mlp(x, counts, *experts.weights(), 32)
    w13, w2 = experts.dequantized()
    with pytest.raises(RuntimeError, match=r"counts\[1\] = -4 is negative"):
        native.silu_expert_mlp(x, counts, w13, w2)
    with pytest.raises(ValueError, match=r"counts\[1\]=-4 is negative"):
        check_sorted_counts(x, counts, E)
    with pytest.raises(ValueError, match=r"counts\[1\]=-4 is negative"):
        check_masked_counts(torch.zeros(E, 4, H), counts, E)
