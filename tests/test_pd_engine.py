"""Prefill/decode disaggregation at the engine level: the prompt runs on a prefill engine,
its KV blocks and first token move to a decode engine, which continues.

- greedy tokens equal a single colocated instance's (and so transformers': test_engine_parity.py holds
  the colocated engine to them) for Qwen3-MoE, DeepSeek-V3 (MLA latent)
  and Llama, with equal layouts and with different ones: attention TP 2 -> 1 (heads re-sharded),
  1 -> 2 with MLA's latent whole on every rank, two pipeline stages -> one (layers re-sharded); long
  prompts are chunked on the prefill side;
- a seeded sampled request draws on the decode side what it would have drawn colocated (its draws are keyed by seed and position);
- KV blocks on both sides come back on abort mid-pull and at the transfer timeout; when the prefill instance is
  gone, the decode instance computes the prompt itself and the request ends as it would have;
- a handle is good for one request: a replay is refused at once, before any transfer (no pull waits
  for blocks that are gone), and so is an expired one; a hand-off the decode side refuses
  (max_tokens < 2, another prompt) frees the prefill's parked blocks at once, not at the timeout;
- an import's grammar compiles off the decode instance's stepping loop: a stream decoding there keeps its
  inter-token gap while it compiles, and the import then gives a colocated instance's tokens; one whose
  compile misses the timeout fails alone, and one aborted while its grammar compiles leaves nothing.
"""
from __future__ import annotations

import itertools
import time

import pytest

from lazy_engines import engine_pool
from pd_helpers import decode, free_blocks, greedy, prefill, run_until, settle, wait_for_free
from pd_helpers import kv_key  # noqa: F401  the module's KV secret (an autouse fixture)
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.disaggregation.kv_transfer.handle import HandleError
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.structured_output import compiler as compiler_module
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[5, 17, 42, 99, 3], [(7 * i + 3) % 500 + 5 for i in range(40)]]   # the second spans 3 blocks
NEW_TOKENS = 6
TIMEOUT_S = 3.0
CASES = [  # arch, prefill layout, decode layout
    ("qwen3_moe", {}, {}),
    ("deepseek_v3", {}, {}),
    ("llama", {}, {}),
    ("qwen3_moe", {"ep": 2, "dp_attn": 1}, {}),     # attention TP 2 (4 KV heads split 2+2) -> TP 1
    ("deepseek_v3", {}, {"ep": 2, "dp_attn": 1}),   # MLA: the latent is whole on every decode rank
    ("llama", {"pp": 2}, {}),                       # two pipeline stages -> one: layers re-sharded
    ("qwen3_moe", {}, {"ep": 2, "dp_attn": 2}),     # DP attention: the other worker steps with the importing one
]
ids = itertools.count()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory, kv_key):
    """`engines(arch, mode, **layout)`: one engine per (arch, mode, layout) for the module."""
    def build(arch: str, mode: str, layout: tuple):
        return make_engine(EngineConfig(
            model=str(tiny_checkpoint_factory(arch)), device="cpu", kv_cache_memory=2 * 2**20,
            max_num_batched_tokens=16, disaggregation_mode=mode, kv_transfer_timeout_s=TIMEOUT_S, **dict(layout)))

    with engine_pool(build) as pooled:
        yield lambda arch, mode, **layout: pooled(arch, mode, tuple(sorted(layout.items())))


@pytest.fixture(scope="module")
def expected(engines):
    """A single colocated instance's greedy tokens for PROMPTS, per arch."""
    cache = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            colocated = engines(arch, "none")
            for index, prompt in enumerate(PROMPTS):
                colocated.add_request(f"colocated-{arch}-{index}", prompt, greedy(NEW_TOKENS))
            cache[arch] = [run_until([colocated], f"colocated-{arch}-{index}").token_ids
                           for index in range(len(PROMPTS))]
        return cache[arch]

    return get


def layout_id(layout: dict) -> str:
    return "+".join(f"{name}{value}" for name, value in layout.items()) or "1rank"


@pytest.mark.parametrize("arch,prefill_layout,decode_layout", CASES,
                         ids=[f"{a}-P_{layout_id(p)}-D_{layout_id(d)}" for a, p, d in CASES])
def test_prefill_there_decode_here_equals_one_instance(engines, expected, arch, prefill_layout, decode_layout):
    p, d = engines(arch, "prefill", **prefill_layout), engines(arch, "decode", **decode_layout)
    p_free, d_free = free_blocks(p), free_blocks(d)
    for prompt, want in zip(PROMPTS, expected(arch)):
        first = prefill(p, f"p{next(ids)}", prompt)
        assert first.finish_reason == "length" and first.token_ids == want[:1] and first.kv_handle is not None
        done = decode(p, d, f"d{next(ids)}", prompt, first.kv_handle, NEW_TOKENS)
        assert (done.finish_reason, done.token_ids) == ("length", want)
    wait_for_free([(p, p_free), (d, d_free)])   # the prefill's copy released, the decode's freed at the end


def test_imports_past_max_num_seqs_wait_their_turn_holding_their_blocks(engines, expected):
    """A decode instance with max_num_seqs=1 takes two imports that land together: the second waits, holding its
    blocks, while the first decodes alone (a decode step never holds more sequences than the decode bound sizes),
    then decodes; both give one instance's tokens."""
    p, d = engines("llama", "prefill"), engines("llama", "decode", max_num_seqs=1)
    handles = [prefill(p, f"p{next(ids)}", prompt).kv_handle for prompt in PROMPTS]
    request_ids = [f"d{next(ids)}" for _ in PROMPTS]
    for request_id, prompt, handle in zip(request_ids, PROMPTS, handles):
        d.add_request(request_id, prompt, greedy(NEW_TOKENS), import_kv=handle)
    scheduler, most_running, waited = d.core.scheduler, 0, False
    done: dict = {}
    deadline = time.monotonic() + 60
    while len(done) < len(request_ids) and time.monotonic() < deadline:
        for engine in (d, p):
            done.update((o.request_id, o) for o in engine.step() if o.request_id in request_ids and o.finished)
        most_running = max(most_running, len(scheduler.running))
        waited = waited or (bool(scheduler.landed) and bool(scheduler.running))
    assert [done[request_id].token_ids for request_id in request_ids] == expected("llama")
    assert most_running == 1 and waited


def test_a_seeded_request_draws_what_it_would_on_one_instance(engines):
    p, d = engines("qwen3_moe", "prefill"), engines("qwen3_moe", "decode")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    prompt = PROMPTS[1]
    p.add_request("colocated", prompt, params)           # a prefill instance serves whole requests too
    colocated = run_until([p], "colocated")
    p.add_request("seeded-p", prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=7, ignore_eos=True),
                  export_kv=True)
    first = run_until([p], "seeded-p")
    done = decode(p, d, "seeded-d", prompt, first.kv_handle, 8, params)
    assert done.token_ids == colocated.token_ids


def test_an_import_aborted_mid_pull_frees_both_sides(engines):
    p, d = engines("deepseek_v3", "prefill"), engines("deepseek_v3", "decode", ep=2, dp_attn=1)
    p_free, d_free = free_blocks(p), free_blocks(d)
    first = prefill(p, "abort-p", PROMPTS[1])
    d.add_request("abort-d", PROMPTS[1], greedy(NEW_TOKENS), import_kv=first.kv_handle)
    assert d.abort("abort-d")                         # before its ranks report: the pull is cancelled
    wait_for_free([(p, p_free), (d, d_free)])


def test_kv_nobody_pulls_is_freed_at_the_timeout_and_a_late_import_fails_alone(engines):
    p, d = engines("llama", "prefill", pp=2), engines("llama", "decode")
    p_free, d_free = free_blocks(p), free_blocks(d)
    first = prefill(p, "orphan", PROMPTS[1])          # the decode instance that should pull it never comes
    assert first.kv_handle is not None
    settle([p], 0.3)
    assert free_blocks(p) < p_free                     # parked, not freed yet
    wait_for_free([(p, p_free)], timeout_s=TIMEOUT_S + 10)
    assert p.stats().transfer.exports_expired >= 1
    with pytest.raises(HandleError, match="expired"):   # refused before anything connects
        d.add_request("late", PROMPTS[1], greedy(NEW_TOKENS), import_kv=first.kv_handle)
    assert free_blocks(d) == d_free and not d.has_unfinished()


def test_a_used_handle_is_refused_at_once_without_a_transfer(engines):
    p, d = engines("qwen3_moe", "prefill"), engines("qwen3_moe", "decode")
    first = prefill(p, "once-p", PROMPTS[1])
    assert decode(p, d, "once-d", PROMPTS[1], first.kv_handle, NEW_TOKENS).finish_reason == "length"
    pulls = settled(d)
    for replay in range(5):
        started = time.monotonic()
        with pytest.raises(HandleError, match="already used"):
            d.add_request(f"replay-{replay}", PROMPTS[1], greedy(NEW_TOKENS), import_kv=first.kv_handle)
        assert time.monotonic() - started < 0.2        # not the 2 s a pull waits for blocks that are gone
    settle([d, p], 0.2)
    assert settled(d) == pulls and not d.has_unfinished()


def test_a_hand_off_the_decode_side_refuses_frees_the_prefill_copy_at_once(engines):
    p, d = engines("qwen3_moe", "prefill"), engines("qwen3_moe", "decode")
    p_free, d_free = free_blocks(p), free_blocks(d)
    for name, prompt, params in (("short", PROMPTS[1], greedy(1)), ("other-prompt", PROMPTS[0], greedy(NEW_TOKENS))):
        first = prefill(p, f"refused-{name}", PROMPTS[1])
        settle([p], 0.1)
        assert free_blocks(p) < p_free                 # parked
        parked_at = time.monotonic()
        with pytest.raises(InvalidRequestError):
            d.add_request(f"refused-{name}-d", prompt, params, import_kv=first.kv_handle)
        wait_for_free([(p, p_free)], timeout_s=1.0)    # the timeout is TIMEOUT_S (3 s)
        assert time.monotonic() - parked_at < TIMEOUT_S
    assert free_blocks(d) == d_free


def settled(engine) -> int:
    """Imports the decode engine settled so far, however they ended."""
    transfer = engine.stats().transfer
    return transfer.transfers + transfer.failures + transfer.recomputed


def test_a_prefill_instance_gone_its_imports_run_their_prompts_on_the_decode_side(engines, tiny_checkpoint_factory):
    """Nothing lost: a request whose KV cannot be pulled (its prefill instance died after handing it out) is
    computed by the decode instance itself, from the prefill's first token on, with the tokens it would have had."""
    d, colocated = engines("deepseek_v3", "decode"), engines("deepseek_v3", "none")
    colocated.add_request("gone-colocated", PROMPTS[1], greedy(NEW_TOKENS))
    want = run_until([colocated], "gone-colocated").token_ids
    gone = make_engine(EngineConfig(model=str(tiny_checkpoint_factory("deepseek_v3")), device="cpu",
                                    kv_cache_memory=2 * 2**20, disaggregation_mode="prefill"))
    first = prefill(gone, "gone-p", PROMPTS[1])
    gone.shutdown()                                    # its block server and release listener close with it
    d_free, recomputed = free_blocks(d), d.stats().transfer.recomputed
    d.add_request("gone-d", PROMPTS[1], greedy(NEW_TOKENS), import_kv=first.kv_handle)
    done = run_until([d], "gone-d", timeout_s=TIMEOUT_S + 30)
    assert (done.token_ids, done.finish_reason, done.error) == (want, "length", None)
    assert d.stats().transfer.recomputed == recomputed + 1
    wait_for_free([(d, d_free)])
    p = engines("deepseek_v3", "prefill")               # the decode instance goes on with the others
    first = prefill(p, "after-p", PROMPTS[0])
    assert decode(p, d, "after-d", PROMPTS[0], first.kv_handle, NEW_TOKENS).finish_reason == "length"


SLOW_COMPILE_S = 3.0   # a grammar's compile on the decode instance (a shared CPU's steps were seen at 0.5 s)


@pytest.fixture
def slow_parse(monkeypatch):
    """`slow_parse()`: from now on, parsing a grammar takes SLOW_COMPILE_S (sleeping releases the GIL, as
    xgrammar's C++ does). Called after the prefill side compiled its grammar, so only the decode side's is slow."""
    def start():
        real = compiler_module.parse_grammar

        def slow(*args):
            time.sleep(SLOW_COMPILE_S)
            return real(*args)

        monkeypatch.setattr(compiler_module, "parse_grammar", slow)

    return start


def step_all(engines, done, timeout_s: float = 60.0, pace_s: float = 0.0) -> list:
    """Step every engine until `done(outputs so far)`, at most once per `pace_s`; every output, with the time
    it came."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while not done(seen):
        assert time.monotonic() < deadline, "requests did not finish"
        for engine in engines:
            seen += [(time.perf_counter(), out) for out in engine.step()]
        time.sleep(pace_s)
    return seen


def finished(*request_ids):
    return lambda seen: all(any(out.request_id == r and out.finished for _, out in seen) for r in request_ids)


def structured_first_token(p, request_id: str, prompt: list[int], spec: StructuredOutputSpec):
    p.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, structured_output=spec),
                  export_kv=True)
    return run_until([p], request_id)


def test_an_import_whose_grammar_compiles_slowly_does_not_stall_the_decoding_streams(engines, slow_parse):
    p, d, colocated = engines("qwen3_moe", "prefill"), engines("qwen3_moe", "decode"), engines("qwen3_moe", "none")
    spec = StructuredOutputSpec(regex=r"[a-z]{2,5}-\d{3}")   # compiled nowhere else on the decode instance
    params = SamplingParams(max_tokens=16, temperature=0.0, structured_output=spec)
    colocated.add_request("so-colocated", PROMPTS[1], params)
    want = run_until([colocated], "so-colocated")
    d_free = free_blocks(d)
    stream = prefill(p, "stream-p", PROMPTS[0])
    d.add_request("stream-d", PROMPTS[0], greedy(480), import_kv=stream.kv_handle)   # paced: >= 4.7 s more
    seen = step_all([d, p], lambda seen: sum(out.request_id == "stream-d" for _, out in seen) >= 5)
    first = structured_first_token(p, "so-p", PROMPTS[1], spec)   # d keeps still meanwhile: short
    assert first.token_ids == want.token_ids[:1] and first.kv_handle is not None
    slow_parse()
    added = time.perf_counter()
    d.add_request("so-d", PROMPTS[1], params, import_kv=first.kv_handle)
    seen += step_all([d, p], finished("so-d"), pace_s=0.01)
    ended = time.perf_counter()
    assert ended - added >= SLOW_COMPILE_S * 0.9        # it did wait for its grammar
    times = [when for when, out in seen if out.request_id == "stream-d"]
    assert times[-1] >= added + SLOW_COMPILE_S, "the stream ended before the import's grammar compiled"
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < SLOW_COMPILE_S / 2, f"the stream stalled {max(gaps):.2f}s while a grammar compiled"
    done = next(out for _, out in seen if out.request_id == "so-d" and out.finished)
    assert (done.token_ids, done.finish_reason, done.error) == (want.token_ids, want.finish_reason, None)
    d.abort("stream-d")
    wait_for_free([(d, d_free)])


def test_an_import_whose_grammar_misses_the_compile_timeout_fails_alone(engines, slow_parse, monkeypatch):
    p, d = engines("qwen3_moe", "prefill"), engines("qwen3_moe", "decode")
    monkeypatch.setattr(d.core.grammar_waits, "timeout_s", SLOW_COMPILE_S / 4)
    p_free, d_free = free_blocks(p), free_blocks(d)
    spec = StructuredOutputSpec(regex=r"[0-9]{3}[a-z]{2}")    # compiled nowhere else on the decode instance
    late = structured_first_token(p, "late-p", PROMPTS[1], spec)
    gone_spec = StructuredOutputSpec(regex=r"[a-z]{4}[0-9]")
    gone = structured_first_token(p, "gone-p", PROMPTS[1], gone_spec)
    fine = prefill(p, "fine-p", PROMPTS[0])
    slow_parse()
    started = time.monotonic()
    d.add_request("gone-d", PROMPTS[1], SamplingParams(max_tokens=8, structured_output=gone_spec),
                  import_kv=gone.kv_handle)
    assert d.abort("gone-d")                              # aborted while its grammar compiles: nothing stays
    d.add_request("late-d", PROMPTS[1], SamplingParams(max_tokens=8, structured_output=spec), import_kv=late.kv_handle)
    d.add_request("fine-d", PROMPTS[0], greedy(NEW_TOKENS), import_kv=fine.kv_handle)
    seen = step_all([d, p], finished("late-d", "fine-d"))
    last = {out.request_id: out for _, out in seen}
    assert last["late-d"].finish_reason == "error" and "did not compile within" in last["late-d"].error
    assert time.monotonic() - started < SLOW_COMPILE_S    # failed at the timeout, not when the compile ended
    assert last["fine-d"].finish_reason == "length" and len(last["fine-d"].token_ids) == NEW_TOKENS
    wait_for_free([(p, p_free), (d, d_free)])
    assert not d.has_unfinished() and not d.core.imports and not d.core.imports.grammars
