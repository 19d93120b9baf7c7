"""Backend selection, capabilities, input errors, DeepEP's absence, and send-once traffic stats."""

import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist

import moe_runtime.dispatch.deepep
import moe_runtime.dispatch.factory
from moe_runtime.dispatch import (LAYOUT_CONTIGUOUS, LAYOUT_MASKED, DispatchConfig, LocalDispatcher, make_dispatcher,
                                  select_backend)
from deepep_emulation import EmulatedDeepEPBuffer
from moe_runtime.load_balancer import SlotGeometry
from multirank import MultiRankError, ranks  # noqa: F401  (fixture)


# ------------------------------------------------------------------------ backend selection
def test_auto_picks_local_for_one_rank_and_all_to_all_on_cpu():
    assert select_backend("auto", "cpu", 1) == "local"
    assert select_backend("auto", "cpu", 4, "prefill") == "all_to_all"
    assert select_backend("auto", "cpu", 4, "decode") == "all_to_all"


def test_auto_on_cuda_without_deep_ep_falls_back_to_all_to_all(monkeypatch):
    monkeypatch.setattr(moe_runtime.dispatch.factory, "deep_ep_importable", lambda module: False)
    assert select_backend("auto", "cuda", 8, "decode") == "all_to_all"


def test_auto_on_cuda_with_deep_ep_picks_mode_by_phase(monkeypatch):
    monkeypatch.setattr(moe_runtime.dispatch.factory, "deep_ep_importable", lambda module: True)
    assert select_backend("auto", "cuda", 8, "prefill") == "deepep_normal"
    assert select_backend("auto", "cuda", 8, None) == "deepep_normal"
    assert select_backend("auto", "cuda", 8, "decode") == "deepep_low_latency"
    assert select_backend("auto", "cuda", 1, "decode") == "local"


def test_named_backends_pass_through_and_bad_names_are_rejected():
    assert select_backend("allgather", "cpu", 2) == "allgather"
    assert select_backend("deepep", "cpu", 2, "decode") == "deepep_low_latency"
    with pytest.raises(ValueError, match="'nccl_magic'"):
        select_backend("nccl_magic", "cpu", 2)
    with pytest.raises(ValueError, match="phase 'training'"):
        select_backend("auto", "cpu", 2, "training")
    with pytest.raises(ValueError, match="'local' needs world_size 1"):
        select_backend("local", "cpu", 2)


def test_importing_dispatch_does_not_import_deep_ep():
    assert "deep_ep" not in sys.modules


@pytest.mark.skipif(moe_runtime.dispatch.factory.deep_ep_importable(), reason="deep_ep is installed here: nothing is missing")
def test_missing_deep_ep_is_a_clear_error():
    with pytest.raises(ImportError, match="deep_ep"):
        make_dispatcher(DispatchConfig("deepep_normal", SlotGeometry(8, 2), 0, None, 16))


# ------------------------------------------------------------------------ capabilities
class _NoCommBuffer(EmulatedDeepEPBuffer):
    """Constructible without a process group: enough to inspect an adapter's capabilities."""

    def __init__(self, group, *args, **kwargs):
        self.group, self.rank, self.group_size = group, 0, 2


DEEPEP_HIDDEN = 2048   # one of DeepEP's low-latency sizes (its kernels take bf16 rows: DispatchConfig's default)


def test_capabilities_are_methods():
    local = make_dispatcher(DispatchConfig("local", SlotGeometry(4, 1), 0, None, 8))
    assert (local.layout(), local.max_tokens_per_rank(), local.supports_async()) == \
        (LAYOUT_CONTIGUOUS, None, False)
    low_latency = make_dispatcher(DispatchConfig("deepep", SlotGeometry(4, 2), 0, None, DEEPEP_HIDDEN, phase="decode",
                                                 max_tokens_per_rank=32,
                                                 deepep_buffer_cls=_NoCommBuffer))
    assert (low_latency.layout(), low_latency.max_tokens_per_rank()) == (LAYOUT_MASKED, 32)
    normal = make_dispatcher(DispatchConfig("deepep", SlotGeometry(4, 2), 0, None, DEEPEP_HIDDEN, phase="prefill",
                                            deepep_buffer_cls=_NoCommBuffer))
    assert (normal.layout(), normal.max_tokens_per_rank()) == (LAYOUT_CONTIGUOUS, None)


def test_low_latency_needs_a_token_bound():
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        make_dispatcher(DispatchConfig("deepep_low_latency", SlotGeometry(4, 2), 0, None, DEEPEP_HIDDEN,
                                       deepep_buffer_cls=_NoCommBuffer))


# ------------------------------------------------------------------------ input errors
@pytest.fixture
def local():
    return LocalDispatcher(SlotGeometry(num_slots=4, num_ranks=1), hidden_size=8)


def _inputs(tokens=3, k=2):
    return torch.randn(tokens, 8), torch.zeros(tokens, k, dtype=torch.int64), torch.ones(tokens, k)


@pytest.mark.parametrize("mutate, culprit", [
    (lambda x, s, w: (x[0], s, w), "x must be"),
    (lambda x, s, w: (x[:, :4], s, w), "hidden_size=8"),
    (lambda x, s, w: (x, s[:2], w), "slot_ids must be"),
    (lambda x, s, w: (x, s.int(), w), "slot_ids must be int64"),
    (lambda x, s, w: (x, s, w[:, :1]), "weights must have the shape"),
    (lambda x, s, w: (x, s + 4, w), "slot_ids holds slot 4"),
])
def test_bad_inputs_name_the_tensor_at_fault(local, mutate, culprit):
    with pytest.raises(ValueError, match=culprit):
        local.dispatch(*mutate(*_inputs()))


def test_combine_rejects_wrongly_shaped_expert_output(local):
    out = local.dispatch(*_inputs())
    with pytest.raises(ValueError, match="expert_out"):
        local.combine(out.recv_x[1:], out.handle)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        DispatchConfig("auto", SlotGeometry(8, 2), 2, None, 16)
    with pytest.raises(ValueError, match="DispatchConfig.backend"):
        DispatchConfig("fast", SlotGeometry(8, 2), 0, None, 16)
    with pytest.raises(ValueError, match="needs slots on one rank"):
        LocalDispatcher(SlotGeometry(num_slots=4, num_ranks=2))


# ------------------------------------------------------------------------ multi-rank behaviour
def _too_many_tokens_for_low_latency():
    rank = dist.get_rank()
    dispatcher = make_dispatcher(DispatchConfig("deepep_low_latency", SlotGeometry(4, 2), rank, None, DEEPEP_HIDDEN,
                                                max_tokens_per_rank=2,
                                                deepep_buffer_cls=EmulatedDeepEPBuffer))
    slots, weights = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    dispatcher.dispatch(torch.randn(3, DEEPEP_HIDDEN, dtype=torch.bfloat16), slots, weights)


def test_low_latency_rejects_more_tokens_than_its_bound(ranks):
    with pytest.raises(MultiRankError, match="max_tokens_per_rank=2"):
        ranks(2).run(_too_many_tokens_for_low_latency)


def _send_once_stats(send_once: bool):
    """Rank 0 routes token 0 to slots {0, 1, 2} (rank 0) + {3} (rank 1), token 1 to {4, 5}."""
    rank = dist.get_rank()
    hidden = 16
    dispatcher = make_dispatcher(DispatchConfig("all_to_all", SlotGeometry(6, 2), rank, None, hidden,
                                                torch.float32, send_once=send_once))
    if rank == 0:
        slots = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]])
    else:
        slots = torch.tensor([[3, 4, 5, 0]])
    x = torch.randn(slots.shape[0], hidden)
    weights = torch.rand(slots.shape)
    out = dispatcher.dispatch(x, slots, weights)
    y = dispatcher.combine(out.recv_x * 2.0, out.handle)  # expert = doubling
    expected = 2.0 * torch.where(slots >= 0, weights, 0.0).sum(dim=1, keepdim=True) * x
    torch.testing.assert_close(y, expected)
    return dataclasses.asdict(dispatcher.last_stats)


def test_all_to_all_sends_each_token_once_per_rank(ranks):
    deduped = ranks(2).run(_send_once_stats, True)
    per_pair = ranks(2).run(_send_once_stats, False)
    row_bytes = 16 * 4
    # rank 0: token 0 -> ranks {0, 1}, token 1 -> rank {1}: 3 rows for 6 pairs.
    assert deduped[0]["pairs_routed"] == 6 and deduped[0]["rows_sent"] == 3
    assert deduped[0]["rows_sent_remote"] == 2
    # rank 1: token 0 -> ranks {1, 0}: 2 rows for 4 pairs.
    assert deduped[1]["pairs_routed"] == 4 and deduped[1]["rows_sent"] == 2
    assert [s["rows_sent"] for s in per_pair] == [6, 4]
    assert [s["bytes_saved_by_dedup"] for s in per_pair] == [0, 0]
    # Saved: dispatch rows not sent plus combine rows not returned (rank 0 receives token 0 of
    # rank 1 for 1 pair and its own token 0 for 3 pairs: 2 rows instead of 4).
    assert deduped[0]["bytes_saved_by_dedup"] == ((6 - 3) + (4 - 2)) * row_bytes
    for dedup, naive in zip(deduped, per_pair):
        assert dedup["dispatch_bytes"] < naive["dispatch_bytes"]
        assert dedup["combine_bytes"] < naive["combine_bytes"]


def test_combine_reduction_in_small_chunks_matches_one_pass(monkeypatch):
    import moe_runtime.dispatch.grouping
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=gen)
    slots = torch.randint(-1, 6, (40, 3), generator=gen)
    weights = torch.rand(40, 3, generator=gen)
    dispatcher = LocalDispatcher(SlotGeometry(num_slots=6, num_ranks=1))
    out = dispatcher.dispatch(x, slots, weights)
    one_pass = dispatcher.combine(out.recv_x * 3.0, out.handle)
    monkeypatch.setattr(moe_runtime.dispatch.grouping, "REDUCE_CHUNK_ELEMENTS", 8 * 7)  # 7 rows per chunk
    chunked = dispatcher.combine(out.recv_x * 3.0, out.handle)
    expected = 3.0 * torch.where(slots >= 0, weights, 0.0).sum(dim=1, keepdim=True) * x
    torch.testing.assert_close(chunked, one_pass)
    torch.testing.assert_close(chunked, expected)


def test_derived_low_latency_choice_without_token_bound_uses_normal_mode(monkeypatch):
    monkeypatch.setattr(moe_runtime.dispatch.factory, "deep_ep_importable", lambda module: True)
    for backend in ("auto", "deepep"):
        unbounded = make_dispatcher(DispatchConfig(backend, SlotGeometry(4, 2), 0, None, DEEPEP_HIDDEN, device="cuda",
                                                   phase="decode",
                                                   deepep_buffer_cls=_NoCommBuffer))
        assert unbounded.layout() == LAYOUT_CONTIGUOUS
    bounded = make_dispatcher(DispatchConfig("auto", SlotGeometry(4, 2), 0, None, DEEPEP_HIDDEN, device="cuda",
                                             phase="decode", max_tokens_per_rank=64,
                                             deepep_buffer_cls=_NoCommBuffer))
    assert bounded.layout() == LAYOUT_MASKED


def test_a_missing_deep_ep_is_looked_for_once_per_process(monkeypatch):
    """'auto' asks for every dispatcher it resolves; a failed import costs 0.3 ms, so the answer is kept."""
    calls = []

    def missing(module):
        calls.append(module)
        raise ImportError("no deep_ep here")

    monkeypatch.setattr(moe_runtime.dispatch.deepep, "import_deep_ep_buffer", missing)
    moe_runtime.dispatch.deepep.deep_ep_importable.cache_clear()
    try:
        assert not moe_runtime.dispatch.deepep.deep_ep_importable() and not moe_runtime.dispatch.deepep.deep_ep_importable()
        assert calls == ["deep_ep"]
    finally:
        moe_runtime.dispatch.deepep.deep_ep_importable.cache_clear()


def test_rows_of_any_strides_pack_to_bytes():
    """A [T, 1] column with stride 0 in its last dimension counts as contiguous (a `ones_like` of an expanded
    tensor is one: Llama 4's top-1 weights handed to the executor) yet has no byte view of its own."""
    from moe_runtime.dispatch.collectives import ColumnSpec, pack_rows, unpack_rows
    strided = torch.as_strided(torch.arange(4.0), (4, 1), (1, 0))
    assert strided.is_contiguous() and strided.stride(-1) == 0
    ids = torch.arange(8).view(4, 2)
    packed = pack_rows(strided, ids)
    back_weights, back_ids = unpack_rows(packed, [ColumnSpec(torch.float32, 1), ColumnSpec(torch.int64, 2)])
    assert torch.equal(back_weights, strided) and torch.equal(back_ids, ids)
