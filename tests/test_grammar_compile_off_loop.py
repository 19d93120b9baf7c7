"""A slow grammar delays its own request only: compiled off the stepping loop, bounded in time and in schema depth.

- in process (tiny checkpoint, the blocking driver): a stream keeps its inter-token gap while another
  request's grammar takes seconds to compile; a compile past `grammar_compile_timeout_s` fails its
  request alone, with an error that says so; an aborted request waiting for its grammar leaves nothing;
- at admission: a schema nested past the bound is refused naming the field, before xgrammar sees it;
- two ranks (one DP worker, TP 2, gloo): both start the request at the same step.
"""
from __future__ import annotations

import json
import time

import pytest

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.structured_output import compiler as compiler_module
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator
from moe_runtime.sampling.structured_output.schema_bounds import MAX_SCHEMA_DEPTH

pytestmark = pytest.mark.timeout(300)

SLOW_COMPILE_S = 4.0   # against the noise of a shared CPU (steps of 0.5 s were seen)
YES_NO = StructuredOutputSpec(grammar='root ::= "yes" | "no"')


def nested_schema(levels: int) -> str:
    """`levels` object schemas, each the only property of the one around it (as text: json.dumps recurses)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + '}, "required": ["a"]}' * levels


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu", max_num_seqs=8,
             grammar_compile_timeout_s=SLOW_COMPILE_S * 3) as engine:
        yield engine


@pytest.fixture
def slow_parse(monkeypatch):
    """Parsing takes SLOW_COMPILE_S (sleeping releases the GIL, as xgrammar's C++ does)."""
    real = compiler_module.parse_grammar

    def slow(*args):
        time.sleep(SLOW_COMPILE_S)
        return real(*args)

    monkeypatch.setattr(compiler_module, "parse_grammar", slow)


def step_until(front, done, timeout_s: float = 120.0) -> list:
    """Step the blocking driver until `done(outputs so far)`; every output, with the time it came."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while not done(seen):
        assert time.monotonic() < deadline, "requests did not finish"
        seen += [(time.perf_counter(), out) for out in front.step()]
    return seen


def finished(*request_ids):
    return lambda seen: all(any(out.request_id == r and out.finished for _, out in seen) for r in request_ids)


def test_a_slow_grammar_does_not_stall_another_stream(llm, slow_parse):
    front = llm.engine
    front.add_request("stream", PROMPTS[0], SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0))
    seen = step_until(front, lambda seen: len(seen) >= 5)
    front.add_request("slow", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, structured_output=YES_NO))
    seen += step_until(front, finished("stream", "slow"))
    times = [when for when, out in seen if out.request_id == "stream"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < SLOW_COMPILE_S / 2, f"the stream stalled {max(gaps):.2f}s while a grammar compiled"
    last = {out.request_id: out for _, out in seen}
    assert last["slow"].finish_reason == "stop" and last["slow"].text in ("yes", "no")
    assert last["stream"].finish_reason == "length" and len(last["stream"].token_ids) == 60


def test_a_compile_past_the_timeout_fails_its_request_alone(llm, slow_parse, monkeypatch):
    monkeypatch.setattr(llm.core.grammar_waits, "timeout_s", SLOW_COMPILE_S / 4)
    spec = StructuredOutputSpec(regex="[a-z]{3}")   # not compiled before: no cache hit
    fine, slow = llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(8), greedy(8, structured_output=spec)])
    assert slow.finish_reason == "error" and "did not compile within" in slow.error
    assert "--grammar-compile-timeout" in slow.error
    assert fine.finish_reason == "length" and len(fine.token_ids) == 8
    blocks = llm.core.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks and not llm.engine.has_unfinished()


def test_aborting_a_request_that_waits_for_its_grammar_leaves_nothing(llm, slow_parse):
    front = llm.engine
    front.add_request("waits", PROMPTS[2],
                      SamplingParams(max_tokens=4, structured_output=StructuredOutputSpec(regex="[0-9]{4}")))
    assert len(front.core.grammar_waits) == 1
    assert front.abort("waits")
    assert len(front.core.grammar_waits) == 0 and not front.core.has_unfinished()
    [out] = llm.generate([PROMPTS[0]], greedy(3))
    assert out.finish_reason == "length"


def test_a_schema_nested_past_the_bound_is_refused_before_xgrammar_reads_it():
    validator = StructuredOutputValidator()
    validator.check(StructuredOutputSpec(json_schema=nested_schema(MAX_SCHEMA_DEPTH // 2 - 1)))
    deep = StructuredOutputSpec(json_schema=nested_schema(600))   # the 27 KB schema: 24.5 s of stall
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.structured_output\.json_schema: .*nested "
                                                  rf".*at most {MAX_SCHEMA_DEPTH}"):
        validator.check(deep)
    assert time.perf_counter() - started < 0.5
    # strings that look like brackets do not count; a bracket inside a string is text
    validator.check(StructuredOutputSpec(json_schema=json.dumps({"type": "string", "description": "[{" * 500})))


def test_the_engine_refuses_the_deep_schema_at_admission(llm):
    with pytest.raises(InvalidRequestError, match=r"structured_output\.json_schema: .*nested"):
        llm.generate([PROMPTS[0]], greedy(4, structured_output=StructuredOutputSpec(json_schema=nested_schema(600))))
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
@pytest.mark.parametrize("ep, dp_attn", [(2, 1), (2, 2)], ids=["one-worker-of-2-ranks", "two-workers"])
def test_ranks_start_each_grammar_request_at_the_same_step(ep, dp_attn, tiny_checkpoint_factory):
    """Ranks compile on their own; the agreement starts each request together (else gloo hangs or tokens differ)."""
    path = str(tiny_checkpoint_factory("qwen3_moe"))
    specs = [YES_NO, None, StructuredOutputSpec(regex=r"[a-z]{2,5}-\d{3}"), None]
    params = [greedy(12, structured_output=spec) if spec else greedy(12) for spec in specs]
    with LLM(path, device="cpu", dtype="float32") as alone:
        expected = [(o.token_ids, o.finish_reason) for o in alone.generate(PROMPTS, params)]
    with LLM(path, device="cpu", dtype="float32", ep=ep, dp_attn=dp_attn) as llm:
        for _ in range(2):   # compiled, then cached on every rank
            assert [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)] == expected
        [single] = llm.generate([PROMPTS[2]], [params[2]])   # alone: the idle world agrees without stepping
        assert (single.token_ids, single.finish_reason) == expected[2]
