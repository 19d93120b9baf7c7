"""The front's text handling: incremental detokenization, stop strings, streaming text that is never
taken back, and deltas whose size does not grow with the output."""
from __future__ import annotations

import msgspec

from moe_runtime.attention_dp.messages import MessageCodec, StepOutputs
from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.engine.stats import WorkerStats
from moe_runtime.front.output_processor import OutputProcessor, held_back_suffix
from moe_runtime.records.outputs import TokenDelta
from moe_runtime.sampling.params import SamplingParams


class ByteTokenizer:
    """Token id -> bytes; decoding a cut UTF-8 sequence gives U+FFFD, as byte-level BPE does."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces = pieces

    def decode(self, token_ids, skip_special_tokens=True) -> str:
        return b"".join(self.pieces[t] for t in token_ids).decode("utf-8", errors="replace")


def run(processor: OutputProcessor, request_id: str, tokens: list[int], last_reason: str = "length"):
    outputs = []
    for index, token in enumerate(tokens):
        reason = last_reason if index == len(tokens) - 1 else None
        step = processor.process([TokenDelta(request_id, [token], None, reason)])
        outputs.extend(step.outputs)
        if step.ended or (outputs and outputs[-1].finished):
            return outputs, step.ended
    return outputs, {}


def test_held_back_suffix_is_the_longest_end_that_starts_a_stop_string():
    assert held_back_suffix("hello wor", ["world"]) == 3
    assert held_back_suffix("hello w", ["xyz", "wo"]) == 1
    assert held_back_suffix("hello", ["world"]) == 0
    assert held_back_suffix("abab", ["abc", "bab!"]) == 3
    assert held_back_suffix("", ["x"]) == 0


def test_a_stop_string_ends_the_request_in_the_front_and_is_never_streamed():
    processor = OutputProcessor(ByteTokenizer({1: b"one", 2: b" S", 3: b"T", 4: b"OP", 5: b"!"}))
    processor.add("r", [9], SamplingParams(max_tokens=10, stop=["STOP"]))
    outputs, stopped = run(processor, "r", [1, 2, 3, 4, 5])
    assert stopped == {"r": "stop"}, "the engine must be told to abort the request"
    assert [o.new_text for o in outputs] == ["one", " ", "", ""]
    final = outputs[-1]
    assert final.finished and final.finish_reason == "stop" and final.text == "one "
    assert final.token_ids == [1, 2, 3, 4]
    assert "r" not in processor
    assert processor.process([TokenDelta("r", [5])]).outputs == [], "late deltas of a stopped request are dropped"


def test_a_held_back_prefix_is_released_when_it_does_not_become_a_stop_string():
    processor = OutputProcessor(ByteTokenizer({1: b"a ST", 2: b"AR", 3: b"!"}))
    processor.add("r", [9], SamplingParams(max_tokens=3, stop=["STOP"]))
    outputs, stopped = run(processor, "r", [1, 2, 3])
    assert stopped == {} and outputs[0].new_text == "a "
    assert "".join(o.new_text for o in outputs) == "a STAR!" == outputs[-1].text


def test_stop_strings_wait_for_min_tokens():
    processor = OutputProcessor(ByteTokenizer({1: b"x", 2: b"STOP", 3: b"y"}))
    processor.add("r", [9], SamplingParams(max_tokens=3, stop=["STOP"], min_tokens=3))
    outputs, stopped = run(processor, "r", [1, 2, 3])
    assert stopped == {} and outputs[-1].finish_reason == "length" and outputs[-1].text == "xSTOPy"


def test_incomplete_utf8_is_held_until_completed():
    e_acute = "é".encode()
    processor = OutputProcessor(ByteTokenizer({1: b"caf", 2: e_acute[:1], 3: e_acute[1:]}))
    processor.add("r", [9], SamplingParams(max_tokens=3))
    outputs, _ = run(processor, "r", [1, 2, 3])
    assert [o.new_text for o in outputs] == ["caf", "", "é"]
    assert [o.new_token_ids for o in outputs] == [[1], [2], [3]]


def test_logprobs_and_errors_pass_through():
    processor = OutputProcessor(ByteTokenizer({1: b"a", 2: b"b"}))
    processor.add("r", [9], SamplingParams(max_tokens=5, logprobs=1))
    lp = TokenLogprob(1, -0.5, {1: -0.5})
    first = processor.process([TokenDelta("r", [1], [lp])]).outputs[0]
    assert first.new_logprobs == [lp] and first.logprobs == [lp]
    failed = processor.process([TokenDelta("r", [], None, "error", "boom")]).outputs[0]
    assert failed.finished and failed.finish_reason == "error" and failed.error == "boom"


def test_abort_gives_the_final_output_once():
    processor = OutputProcessor(None)
    processor.add("r", [9], SamplingParams(max_tokens=5))
    processor.process([TokenDelta("r", [4])])
    final = processor.end("r")
    assert final.finished and final.finish_reason == "abort" and final.token_ids == [4]
    assert processor.end("r") is None


def test_a_delta_with_logprobs_crosses_the_wire_intact():
    """Bytes per token staying flat is checked on a real 2-rank engine (test_control_plane_security)."""
    codec = MessageCodec()
    stats = WorkerStats(0, 1, 0, 100, 90, 0, steps=10**6, step_seconds=1.5)
    decoded = codec.decode_to_front(codec.encode(StepOutputs(rank=0, dp_rank=0, deltas=[
        TokenDelta("r", [7], [TokenLogprob(7, -0.25, {7: -0.25, 8: -1.5})], "length")], stats=stats)))
    assert decoded.deltas[0].new_logprobs[0].top == {7: -0.25, 8: -1.5}
    assert decoded.deltas[0].finish_reason == "length" and decoded.stats == stats
    assert msgspec.msgpack.decode(codec.encode(decoded))["type"] == "StepOutputs"
