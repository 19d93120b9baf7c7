"""Attention sinks (gpt-oss), chunked local attention (Llama 4) and sliding windows through every attention path:
the torch decode kernel and its reference, the torch varlen prefill twin, the seam (`split_attention` with the
engine's batch split, eager and as a captured step computes it), against a float64 oracle
(attention_variant_oracle.py). Every case's block tables point freed early entries at a NaN-filled scratch
block, as a windowed KV cache group's do: no result may depend on it. The Triton kernels run the same cases
in the interpreter, in a child process (attention_variant_triton_cases.py)."""
from pathlib import Path

import pytest
import torch
from triton_interpreter_child import assert_cases_pass_in_interpreter

from attention_variant_oracle import CHUNK, DECODE_CASES, FULL, PREFILL_CASES, WINDOW, variant_case
from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.flashinfer_attention import FlashInferAttention
from moe_runtime.kernels.paged_prefill_attention import PagedPrefillBatch
from moe_runtime.kernels.paged_prefill_attention import paged_prefill_attention as torch_prefill
from moe_runtime.layers.attention import Attention, AttentionShape
from moe_runtime.layers.attention_ops import split_attention, varlen_causal_attention
from moe_runtime.layers.attention_span import SLIDING, AttentionSpan
from moe_runtime.layers.rotary import RotaryEmbedding

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case_name", sorted(PREFILL_CASES))
def test_varlen_prefill_twin_matches_float64(case_name):
    case = variant_case(*PREFILL_CASES[case_name])
    batch = PagedPrefillBatch.build(case.query_lens, case.context_lens, case.tables, case.block_size)
    got = torch_prefill(case.q, case.k_cache, case.v_cache, batch, 0.25, case.span, case.sinks)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), case.expected, **TOLERANCE)


@pytest.mark.parametrize("family", ["torch", "reference"])
@pytest.mark.parametrize("case_name", sorted(DECODE_CASES))
def test_decode_kernel_reads_each_row_from_its_first_key(family, case_name):
    case = variant_case(*DECODE_CASES[case_name])
    starts = case.key_starts() if case.span.windowed else None
    got = get_kernels("cpu", family).paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.tables, torch.tensor(case.context_lens, dtype=torch.int32), 0.25,
        key_starts=starts, sinks=case.sinks)
    torch.testing.assert_close(got.double(), case.expected, **TOLERANCE)


def engine_split(case, kernels, static: bool = False) -> torch.Tensor:
    """The layer's seam over the case's step: one-token rows through the decode kernel, the rest through the
    torch varlen path (`static`: as a captured decode step runs it, Python lists empty)."""
    batch = case.batch()
    kv_heads, dim = case.k_cache.shape[2], case.k_cache.shape[3]

    def fetch(seq):
        slots = batch.context_slots(seq)
        return case.k_cache.reshape(-1, kv_heads, dim)[slots], case.v_cache.reshape(-1, kv_heads, dim)[slots]

    def single(rows, tables, lens, key_starts=None):
        return kernels.paged_decode_attention(case.q if rows is None else case.q[rows], case.k_cache, case.v_cache,
                                              tables, lens, 0.25, key_starts=key_starts, sinks=case.sinks)

    if static:
        batch.static_decode = True
    return split_attention(batch, case.span, single,
                           lambda seqs: varlen_causal_attention(case.q, batch, fetch, 0.25, case.span, seqs, case.sinks))


@pytest.mark.parametrize("span", [CHUNK, WINDOW], ids=["chunked", "sliding"])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_mixed_step_through_the_seam(span, sinks):
    """Decodes past their window or chunk start, one-token chunks, and prefill chunks crossing chunk boundaries
    in one step: the decodes now run in the decode kernel (from shifted tables), the rest varlen."""
    case = variant_case([1, 9, 1, 14, 1], [17, 25, 9, 14, 30], span, sinks, seed=3)
    split = case.batch().split_single_queries(span)
    assert split.single == [0, 2, 4] and split.multi == [1, 3] and split.key_starts is not None
    assert split.block_tables.shape[1] <= -(-span.size // case.block_size) + 1   # only the windows' blocks
    for family in ("torch", "reference"):
        torch.testing.assert_close(engine_split(case, get_kernels("cpu", family)).double(), case.expected, **TOLERANCE)


@pytest.mark.parametrize("case_name", sorted(DECODE_CASES))
def test_a_captured_decode_step_computes_first_keys_on_the_device(case_name):
    case = variant_case(*DECODE_CASES[case_name])
    got = engine_split(case, get_kernels("cpu", "torch"), static=True)
    torch.testing.assert_close(got.double(), case.expected, **TOLERANCE)


def test_large_finite_scratch_values_change_nothing():
    """Finite garbage (not only NaN) in freed blocks leaves every path's output as it was."""
    for fill in (1e4, -3e4):
        case = variant_case([1, 11, 1], [9, 30, 26], CHUNK, True, scratch_fill=fill, seed=5)
        torch.testing.assert_close(engine_split(case, get_kernels("cpu", "torch")).double(), case.expected,
                                   **TOLERANCE)


def test_span_first_keys_on_host_and_device_agree():
    positions = torch.arange(-1, 40)
    for span in (CHUNK, WINDOW, FULL):
        device = span.first_needed_tensor(positions)
        assert device[0] == 0 and device[1:].tolist() == [span.first_needed(p) for p in range(40)]
    assert AttentionSpan.coerce(6) == WINDOW and AttentionSpan.coerce(None) == FULL and AttentionSpan.coerce(CHUNK) == CHUNK
    assert (CHUNK.code, WINDOW.code, FULL.code) == (2, 1, 0)


def test_attention_shape_declares_its_span_and_sinks():
    window = AttentionShape(64, 4, 2, 16, sliding_window=6)
    assert window.span == AttentionSpan(SLIDING, 6)
    assert AttentionShape(64, 4, 2, 16, span=AttentionSpan(SLIDING, 6)).sliding_window == 6
    chunked = AttentionShape(64, 4, 2, 16, span=CHUNK, sinks=True)
    assert chunked.sliding_window is None and AttentionShape(64, 4, 2, 16).span == FULL
    with pytest.raises(ValueError):
        AttentionShape(64, 4, 2, 16, sliding_window=4, span=CHUNK)
    kernels = get_kernels("cpu", "torch")
    rotary = RotaryEmbedding(torch.ones(8), 1.0, False)
    layer = Attention(chunked, rotary, kernels, torch.float32, tp_size=2, tp_rank=1)
    assert layer.kv_cache_spec().span == CHUNK                         # the KV cache groups see the chunk
    assert layer.sinks.shape == (2,) and layer.sinks.dtype == torch.float32   # this rank's heads

    class Reader:
        directory = "fake"

        def read(self, name):
            assert name == "model.layers.0.self_attn.sinks"
            return torch.arange(4.0)

    assert layer.load_weights(Reader(), "model.layers.0.self_attn.") == {"sinks"}
    assert layer.sinks.tolist() == [2.0, 3.0]
    assert Attention(window, rotary, kernels, torch.float32).load_weights(Reader(), "x.") == set()


def test_flashinfer_supports_neither_sinks_nor_chunks():
    attention = FlashInferAttention(None, torch.device("cpu"))
    q, cache = torch.zeros(2, 4, 128, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    assert not attention.supports(q, cache, cache.clone(), sinks=torch.zeros(4))
    assert not attention.supports(q, cache, cache.clone(), span=CHUNK)
    with pytest.raises(ValueError):
        attention.prefill(q, cache, cache.clone(), None, 1.0, CHUNK)
    with pytest.raises(ValueError):
        attention.decode(q, cache, cache.clone(), None, None, 1.0, key_starts=torch.zeros(2, dtype=torch.int32))


def test_captured_decode_runs_past_a_sliding_window(tiny_checkpoint_factory):
    """Mistral with a window of 8, generating well past it: every decode step is captured now (the rows' first
    keys are computed in the graph) and the tokens are the eager ones (which equal transformers')."""
    from engine_helpers import PROMPTS, greedy
    from moe_runtime import LLM

    path, new_tokens = str(tiny_checkpoint_factory("mistral", sliding_window=8)), 16
    with LLM(path, device="cpu", dtype="float32", block_size=4) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, greedy(new_tokens))]
    with LLM(path, device="cpu", dtype="float32", block_size=4, enable_torch_compile=True,
             torch_compile_backend="eager") as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy(new_tokens))]
        stats = llm.core.runner.capture.stats
    assert got == expected
    assert stats.disabled_reason is None and stats.captured_steps == new_tokens - 1


TRITON_CASES = Path(__file__).with_name("attention_variant_triton_cases.py")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the Triton cases run compiled (collect them directly)")
@pytest.mark.triton_interpreter_cases(TRITON_CASES)
def test_triton_kernels_in_interpreter_child(request):
    pytest.importorskip("triton")
    assert_cases_pass_in_interpreter(request, [TRITON_CASES])
