"""FP8 activations on the dispatch wire (DispatchConfig.fp8_activations).

Per-token-group quantization on its own (precision bounds, partial last group, zeros), then every
multi-rank backend with FP8 on 2 gloo ranks against the same dispatch without it: the received
rows are exactly the sender's rows quantized and dequantized (so values and scales crossed the
wire intact), counts are identical, and combine matches the naive all-experts oracle. Bytes are
counted from the messages handed to torch.distributed, not timed. The routing comes from
dispatch_cases.py; hidden sizes are larger here so tokens span several 128-column groups.
"""

import math

import pytest
import torch
import torch.distributed as dist
from deepep_emulation import EmulatedDeepEPBuffer
from dispatch_cases import DEEPEP_BACKENDS, SLOTS_PER_RANK, Experts, dispatch_config, make_case, row_format

import moe_runtime.dispatch.factory
from moe_runtime.dispatch import (LAYOUT_MASKED, DispatchConfig, Dispatcher, Fp8Activations, dequantize,
                                  make_dispatcher, naive_moe_reference, quantize_token_groups)
from moe_runtime.dispatch.activation_wire import ActivationWire
from moe_runtime.dispatch.allgather import AllGatherDispatcher
from moe_runtime.dispatch.collectives import pack_rows, unpack_rows
from moe_runtime.kernels import expert_mlp, masked_expert_mlp
from moe_runtime.load_balancer import SlotGeometry
from multirank import ranks  # noqa: F401  (fixture)

E4M3_REL = 2.0 ** -4       # 3 mantissa bits, round to nearest: half an ulp, relatively
E4M3_SUBNORMAL = 2.0 ** -6  # in units of the group scale: below it, e4m3 steps by 2**-9
FP32_SLOP = 1e-6           # the scale multiplications' own float32 rounding
# all_to_all / allgather quantize any hidden size (200 = one full group + a partial one);
# DeepEP needs hidden divisible by 128.
FP8_BACKENDS = {"all_to_all": 200, "allgather": 200, "deepep_normal": 2048, "deepep_low_latency": 2048}
INTERMEDIATE = 16


def spread_rows(num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """[T, H] with groups of very different magnitudes: group g is scaled by 20 ** -g, so a
    scale applied to the wrong group, or one scale per row, shows as a large error."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 20.0 ** -(torch.arange(hidden) // 128).to(torch.float32)                # [H]
    return torch.randn(num_tokens, hidden, generator=gen) * magnitude


def e4m3_error_ratio(restored: torch.Tensor, original: torch.Tensor, scales: torch.Tensor) -> float:
    """Worst error over its e4m3 bound (<= 1 passes): relative 2**-4 above the group's subnormal
    range, absolute 2**-10 * scale (half of e4m3's subnormal step) within it."""
    if original.numel() == 0:
        return 0.0
    per_column = scales.double().repeat_interleave(128, dim=-1)[..., :original.shape[-1]]   # [T, H]
    err = (restored.double() - original.double()).abs()
    normal = original.double().abs() >= E4M3_SUBNORMAL * per_column
    bound = torch.where(normal, E4M3_REL * original.double().abs(), 2.0 ** -10 * per_column)
    return float((err / (bound * (1 + FP32_SLOP))).max())


# ------------------------------------------------------------------------ quantization
def test_round_trip_is_within_e4m3_precision():
    x = spread_rows(64, 300, seed=0)
    x[3, :128] *= 1e-6                       # a tiny group: its own scale, not the row's
    x[5, 7] = 0.0                            # a zero inside a group
    quantized = quantize_token_groups(x)
    assert quantized.values.dtype == torch.float8_e4m3fn and quantized.scales.dtype == torch.float32
    assert e4m3_error_ratio(dequantize(quantized, torch.float32), x, quantized.scales) <= 1.0
    # Relatively, the error is spent: a real e4m3 cast, not a copy.
    assert float(((dequantize(quantized, torch.float32) - x).abs() / x.abs().clamp(min=1e-3)).max()) > 1e-2


def test_each_group_scale_is_its_amax_over_448_and_the_last_group_may_be_partial():
    x = spread_rows(4, 200, seed=1)           # groups: columns 0..127 and 128..199
    quantized = quantize_token_groups(x)
    assert tuple(quantized.values.shape) == (4, 200) and tuple(quantized.scales.shape) == (4, 2)
    expected = torch.stack([x[:, :128].abs().amax(dim=1), x[:, 128:].abs().amax(dim=1)], dim=1) / 448
    torch.testing.assert_close(quantized.scales, expected, rtol=1e-6, atol=0)
    # Each group's largest entry lands on +-448: the whole e4m3 range is used.
    assert quantized.values.float().abs().amax(dim=1).tolist() == [448.0] * 4
    assert float(quantized.values[:, 128:].float().abs().amax(dim=1).min()) == 448.0


def test_zeros_get_a_finite_scale_and_come_back_as_zeros():
    x = torch.zeros(3, 130)
    x[1, :128] = torch.linspace(-1, 1, 128)   # one row with a real group, a zero partial group
    quantized = quantize_token_groups(x)
    assert bool(torch.isfinite(quantized.scales).all()) and bool((quantized.scales > 0).all())
    assert bool(torch.isfinite(quantized.values.float()).all())
    restored = dequantize(quantized, torch.bfloat16)
    assert restored.dtype == torch.bfloat16
    assert float(restored[0].abs().max()) == 0.0 and float(restored[1, 128:].abs().max()) == 0.0
    empty = quantize_token_groups(torch.zeros(0, 300))
    assert (tuple(empty.values.shape), tuple(empty.scales.shape)) == ((0, 300), (0, 3))
    assert tuple(dequantize(empty, torch.float32).shape) == (0, 300)


def test_dequantize_takes_leading_dims_and_column_major_scales():
    x = spread_rows(6, 256, seed=2)
    quantized = quantize_token_groups(x)
    values = quantized.values.view(2, 3, 256)                                  # [E, M, H]
    scales = quantized.scales.view(2, 3, 2).transpose(1, 2).contiguous().transpose(1, 2)
    assert not scales.is_contiguous()                                          # DeepEP's layout
    restored = dequantize(Fp8Activations(values, scales), torch.float32)
    torch.testing.assert_close(restored.view(6, 256), dequantize(quantized, torch.float32), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not match"):
        dequantize(Fp8Activations(quantized.values, quantized.scales[:, :1]), torch.float32)


def test_wire_row_is_values_then_scales():
    wire = ActivationWire(200, torch.bfloat16, fp8=True)
    x = spread_rows(3, 200, seed=4).to(torch.bfloat16)
    row = pack_rows(*wire.encode(x))                                            # what a rank sends
    quantized = quantize_token_groups(x)
    assert tuple(row.shape) == (3, wire.row_bytes) and wire.row_bytes == 200 + 4 * 2
    assert torch.equal(row[:, :200], quantized.values.view(torch.uint8))
    assert torch.equal(row[:, 200:].contiguous().view(torch.float32), quantized.scales)
    assert torch.equal(wire.decode(unpack_rows(row, wire.specs())), dequantize(quantized, torch.bfloat16))
    assert ActivationWire(200, torch.bfloat16).row_bytes == 400
    assert ActivationWire(7168, torch.bfloat16, fp8=True).row_bytes / (2 * 7168) == pytest.approx(0.516, abs=1e-3)


# ------------------------------------------------------------------------ capability / refusal
class _NoCommBuffer(EmulatedDeepEPBuffer):
    """Constructible without a process group: enough to build an adapter and ask it."""

    def __init__(self, group, *args, **kwargs):
        self.group, self.rank, self.group_size = group, 0, 2


def _config(backend, hidden, **kwargs):
    return DispatchConfig(backend, SlotGeometry(4, 2), 0, None, hidden, max_tokens_per_rank=8,
                          deepep_buffer_cls=_NoCommBuffer, fp8_activations=True, **kwargs)


@pytest.mark.parametrize("backend", ["deepep", "deepep_normal", "deepep_low_latency"])
def test_deepep_refuses_fp8_for_hidden_sizes_it_cannot_scale(backend):
    with pytest.raises(ValueError, match=f"backend '{backend}' cannot send FP8.*divisible by 128, got 200"):
        _config(backend, 200)
    assert make_dispatcher(_config(backend, 2048)).sends_fp8_activations()


def test_auto_is_checked_once_resolved(monkeypatch):
    monkeypatch.setattr(moe_runtime.dispatch.factory, "deep_ep_importable", lambda module: True)
    config = _config("auto", 200, device="cuda", phase="prefill")   # 'auto' names no class yet
    with pytest.raises(ValueError, match=r"'deepep_normal' \(chosen for 'auto'\) cannot send FP8"):
        make_dispatcher(config)
    monkeypatch.setattr(moe_runtime.dispatch.factory, "deep_ep_importable", lambda module: False)
    assert make_dispatcher(config).sends_fp8_activations()          # all_to_all


def test_a_backend_without_an_fp8_wire_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(AllGatherDispatcher, "fp8_activations_refusal",
                        classmethod(Dispatcher.fp8_activations_refusal.__func__))
    with pytest.raises(ValueError, match="backend 'allgather' cannot send FP8.*no FP8 wire format"):
        _config("allgather", 256)


@pytest.mark.parametrize("backend", ["all_to_all", "allgather"])
def test_capability_follows_the_option(backend):
    assert make_dispatcher(_config(backend, 200)).sends_fp8_activations()
    plain = DispatchConfig(backend, SlotGeometry(4, 2), 0, None, 200)
    assert not make_dispatcher(plain).sends_fp8_activations()


def test_local_accepts_and_ignores_the_option():
    dispatcher = make_dispatcher(DispatchConfig("auto", SlotGeometry(4, 1), 0, None, 200, fp8_activations=True))
    assert not dispatcher.sends_fp8_activations()
    x = spread_rows(5, 200, seed=3)
    slots = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0], [-1, -1]])
    out = dispatcher.dispatch(x, slots, torch.rand(5, 2))
    expected = torch.cat([x[(slots == s).any(dim=1)] for s in range(4)])
    assert torch.equal(out.recv_x, expected)                         # exact: nothing quantized


# ------------------------------------------------------------------------ backends on 2 ranks
def _experts(num_slots: int, hidden: int) -> Experts:
    gen = torch.Generator().manual_seed(99)
    return Experts(w13=torch.randn(num_slots, 2 * INTERMEDIATE, hidden, generator=gen) / math.sqrt(hidden),
                   w2=torch.randn(num_slots, hidden, INTERMEDIATE, generator=gen) / math.sqrt(INTERMEDIATE))


def _valid_rows(out, layout: str) -> torch.Tensor:
    """recv_x's rows that hold tokens, expert by expert: [N, H]."""
    if layout != LAYOUT_MASKED:
        return out.recv_x
    rows = [out.recv_x[e, :c] for e, c in enumerate(out.tokens_per_local_expert.tolist())]
    return torch.cat(rows) if rows else out.recv_x[0, :0]


def _fp8_against_plain(backend: str, scenario: str, hidden: int):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    case = make_case(scenario, world_size, rank)
    rows = row_format(backend)                                       # DeepEP's are bf16
    x = spread_rows(case.x.shape[0], hidden, seed=rank).to(rows.dtype)
    experts = _experts(SLOTS_PER_RANK * world_size, hidden)
    plain = make_dispatcher(dispatch_config(backend, world_size, rank, hidden_size=hidden))
    fp8 = make_dispatcher(dispatch_config(backend, world_size, rank, hidden_size=hidden, fp8_activations=True))

    out_plain = plain.dispatch(x, case.slot_ids, case.weights)
    out_fp8 = fp8.dispatch(x, case.slot_ids, case.weights)
    mine = slice(rank * SLOTS_PER_RANK, (rank + 1) * SLOTS_PER_RANK)
    run = masked_expert_mlp if fp8.layout() == LAYOUT_MASKED else expert_mlp
    w13, w2 = experts.w13[mine].to(rows.dtype), experts.w2[mine].to(rows.dtype)
    y = fp8.combine(run(out_fp8.recv_x, out_fp8.tokens_per_local_expert, w13, w2), out_fp8.handle)
    plain.combine(run(out_plain.recv_x, out_plain.tokens_per_local_expert, w13, w2), out_plain.handle)

    sent = _valid_rows(out_plain, plain.layout())                    # exact rows, [N, H]
    got = _valid_rows(out_fp8, fp8.layout())
    quantized = quantize_token_groups(sent)

    def reference(inputs):
        return naive_moe_reference(inputs.double(), case.slot_ids, case.weights.double(),
                                   SLOTS_PER_RANK * world_size, lambda s, v: experts.oracle(s, v.float()).double())

    exact_ref = reference(x)
    quantized_ref = reference(dequantize(quantize_token_groups(x), rows.dtype))
    return {
        "compute_dtype": str(rows.dtype), "tolerance": rows.tolerance,
        # dequantized into bf16, a value is rounded once more: bf16's half-ulp (2^-9) on top of e4m3's (2^-4)
        "e4m3_error_bound": 1.0 + (2.0 ** -5 if rows.dtype == torch.bfloat16 else 0.0),
        "sends_fp8": fp8.sends_fp8_activations(),
        "recv_dtype": str(out_fp8.recv_x.dtype), "recv_shape": tuple(out_fp8.recv_x.shape),
        "plain_recv_shape": tuple(out_plain.recv_x.shape),
        "counts": out_fp8.tokens_per_local_expert.tolist(),
        "plain_counts": out_plain.tokens_per_local_expert.tolist(),
        "rows_are_quantized_round_trip": torch.equal(got, dequantize(quantized, rows.dtype)),
        "e4m3_error_ratio": e4m3_error_ratio(got, sent, quantized.scales),
        "y_shape": tuple(y.shape), "x_shape": tuple(x.shape),
        "err_vs_quantized_ref": float((y.double() - quantized_ref).abs().max()) if y.numel() else 0.0,
        "err_vs_exact_ref": float((y.double() - exact_ref).abs().max()) if y.numel() else 0.0,
        "ref_scale": float(exact_ref.abs().max()) if exact_ref.numel() else 0.0,
    }


@pytest.mark.parametrize("scenario", ["uneven", "masked", "zero_tokens"])
@pytest.mark.parametrize("backend", sorted(FP8_BACKENDS))
def test_fp8_dispatch_matches_plain_dispatch_within_fp8_precision(ranks, backend, scenario):
    for rank, res in enumerate(ranks(2).run(_fp8_against_plain, backend, scenario, FP8_BACKENDS[backend])):
        where = f"rank {rank}"
        assert res["sends_fp8"], where
        assert res["recv_dtype"] == res["compute_dtype"], where            # dequantized to the compute dtype
        assert res["recv_shape"] == res["plain_recv_shape"], where
        assert res["counts"] == res["plain_counts"], where
        assert res["rows_are_quantized_round_trip"], f"{where}: values or scales changed on the wire"
        assert res["e4m3_error_ratio"] <= res["e4m3_error_bound"], where
        assert res["y_shape"] == res["x_shape"], where
        scale = max(1.0, res["ref_scale"])
        assert res["err_vs_quantized_ref"] <= res["tolerance"] * scale, f"{where}: {res['err_vs_quantized_ref']}"
        assert res["err_vs_exact_ref"] <= 2.0 ** -4 * scale, f"{where}: {res['err_vs_exact_ref']}"


def _dispatch_message_bytes(backend: str, hidden: int):
    """Bytes this rank hands to torch.distributed during one dispatch, plain (bf16, float32)
    and FP8, with the dispatcher's own count where it keeps one."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    case = make_case("uneven", world_size, rank)
    x = spread_rows(case.x.shape[0], hidden, seed=rank)
    sent = [0]

    def counting(collective, copies):
        def wrapper(output, tensor, *args, **kwargs):   # every one used takes (output, input, ...)
            sent[0] += tensor.numel() * tensor.element_size() * copies
            return collective(output, tensor, *args, **kwargs)
        return wrapper

    # all_to_all_single sends its input once (split over ranks); an all-gather sends it to every rank.
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather_single",
                                                        "all_gather_into_tensor") if hasattr(dist, name)}
    copies = {"all_to_all_single": 1, "all_gather_single": world_size, "all_gather_into_tensor": world_size}
    results = {}
    variants = (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                ("fp8_bf16", torch.bfloat16, True), ("fp8_fp32", torch.float32, True))
    for name, dtype, fp8 in variants:
        if backend in DEEPEP_BACKENDS and dtype != torch.bfloat16:
            continue                                                   # DeepEP moves bf16 rows only
        dispatcher = make_dispatcher(dispatch_config(backend, world_size, rank, dtype, hidden_size=hidden,
                                                     fp8_activations=fp8))
        sent[0] = 0
        try:
            for fn_name, fn in originals.items():
                setattr(dist, fn_name, counting(fn, copies[fn_name]))
            out = dispatcher.dispatch(x.to(dtype), case.slot_ids, case.weights)
        finally:
            for fn_name, fn in originals.items():
                setattr(dist, fn_name, fn)
        dispatcher.combine(torch.zeros_like(out.recv_x), out.handle)   # every rank joins combine
        stats = dispatcher.last_stats
        results[name] = {"measured": sent[0], "recv_dtype": str(out.recv_x.dtype),
                         "stats_dispatch": getattr(stats, "dispatch_bytes", None),
                         "stats_combine": getattr(stats, "combine_bytes", None)}
    return results


@pytest.mark.parametrize("backend", sorted(FP8_BACKENDS))
def test_fp8_roughly_halves_bf16_and_quarters_float32_dispatch_bytes(ranks, backend):
    counted = backend in ("all_to_all", "allgather")             # the DeepEP adapter keeps no byte count
    for rank, res in enumerate(ranks(2).run(_dispatch_message_bytes, backend, 2048)):
        where = f"rank {rank}"
        assert res["fp8_bf16"]["recv_dtype"] == "torch.bfloat16", where
        assert 0.5 <= res["fp8_bf16"]["measured"] / res["bf16"]["measured"] <= 0.55, (where, res)
        if backend not in DEEPEP_BACKENDS:                           # DeepEP moves bf16 rows only
            assert res["fp8_fp32"]["measured"] == res["fp8_bf16"]["measured"], where   # the wire ignores dtype
            assert 0.25 <= res["fp8_fp32"]["measured"] / res["fp32"]["measured"] <= 0.28, (where, res)
        if counted:
            for name, variant in res.items():
                assert variant["stats_dispatch"] == variant["measured"], (where, name, variant)
            assert res["fp8_bf16"]["stats_combine"] == res["bf16"]["stats_combine"], where
