"""Streamed text pieces: held back while they may still turn into a stop string or complete a UTF-8 char."""
from server.deltas import ChoiceTracker, held_back_suffix
from moe_runtime.outputs import RequestOutput


def output(text: str, tokens: list[int], finished=False, reason=None) -> RequestOutput:
    return RequestOutput("r", [1], tokens, text, finished, reason)


def test_held_back_suffix_is_the_longest_end_that_starts_a_stop_string():
    assert held_back_suffix("hello wor", ["world"]) == 3
    assert held_back_suffix("hello w", ["xyz", "wo"]) == 1
    assert held_back_suffix("hello", ["world"]) == 0
    assert held_back_suffix("abab", ["abc", "bab!"]) == 3
    assert held_back_suffix("", ["x"]) == 0


def test_stream_never_sends_text_that_a_stop_string_later_removes():
    tracker = ChoiceTracker(["STOP"])
    pieces = [
        tracker.advance(output("one S", [1, 2])).text,
        tracker.advance(output("one ST", [1, 2, 3])).text,
        tracker.advance(output("one ", [1, 2, 3, 4], finished=True, reason="stop")).text,  # engine cut "STOP"
    ]
    assert pieces == ["one ", "", ""]
    assert "".join(pieces) == "one "
    assert tracker.finish_reason == "stop"


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop_string():
    tracker = ChoiceTracker(["STOP"])
    pieces = [tracker.advance(output("a ST", [1])).text, tracker.advance(output("a STAR", [1, 2])).text,
              tracker.advance(output("a STAR!", [1, 2, 3], finished=True, reason="length")).text]
    assert "".join(pieces) == "a STAR!"
    assert pieces[0] == "a "


def test_incomplete_utf8_is_held_until_completed():
    tracker = ChoiceTracker()
    first = tracker.advance(output("caf\ufffd", [1]))
    second = tracker.advance(output("café", [1, 2]))
    assert (first.text, second.text) == ("caf", "é")
    assert (first.token_ids, second.token_ids) == ([1], [2])


def test_tokens_and_logprobs_are_counted_once_even_when_outputs_merge():
    tracker = ChoiceTracker()
    tracker.advance(output("a", [1]))
    delta = tracker.advance(output("abc", [1, 2, 3], finished=True, reason="length"))
    assert delta.token_ids == [2, 3] and delta.text == "bc" and delta.finish_reason == "length"
    assert tracker.num_tokens == 3
