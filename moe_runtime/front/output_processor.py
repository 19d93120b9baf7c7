"""The front's half of every request: from the ranks' token deltas to text, stop strings and outputs.

Ranks only sample token ids and send, per step and request, a `TokenDelta` (the new tokens, their
logprobs, a finish reason). Everything textual happens here, once, in the front process: the
incremental detokenization, the stop strings (with min_tokens), and the text that is safe to
stream. So no rank waits for another's detokenizer at the next collective, and the bytes a rank
sends per request per step do not grow with the output.

A stop string ends a request here, before the ranks know: `process` returns those request ids, with
the reason, so the engine aborts them (their KV blocks are freed at the next step boundary); deltas the ranks
sent meanwhile are ignored.

Streaming text (`RequestOutput.new_text`) is never taken back: a trailing U+FFFD (an incomplete
UTF-8 sequence that the next token may complete) and a suffix that may yet become a stop string
are held back until they are decided; the finished text is decoded whole once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_runtime.errors import error_message
from moe_runtime.sampling.logprobs import PromptTokenLogprob, TokenLogprob
from moe_runtime.front.detokenizer import DecodeState, Detokenizer, cut_at_stop
from moe_runtime.records.outputs import RequestOutput, TokenDelta
from moe_runtime.sampling.params import SamplingParams


def held_back_suffix(text: str, stop_strings: list[str]) -> int:
    """Length of the longest end of `text` that starts some stop string (it may yet become one)."""
    longest = 0
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


@dataclass
class RequestState:
    """One request as the front sees it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text: str = ""
    sent_text_len: int = 0            # characters of `text` already handed out as new_text
    sent_pieces: list[str] = field(default_factory=list)  # ... as handed out (checked once, at the end)
    decode_state: DecodeState = field(default_factory=DecodeState)
    num_preemptions: int = 0
    export_kv: bool = False           # a prefill instance parks its KV after its first token (sent so again on resume)
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None   # from the first delta, when asked for
    cached_prompt_tokens: int = 0     # from the first delta: prompt tokens the prefix cache held
    stop_string: str | None = None    # the stop string that ended it
    routed_rows: list = field(default_factory=list)   # return_routed_experts: each delta's rows (numpy arrays)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput]
    ended: dict[str, str]             # request id -> finish reason ("stop", "error") of requests this front
                                      # ended while the engine still runs them: abort them there


class OutputProcessor:
    def __init__(self, tokenizer):
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, export_kv: bool = False) -> None:
        self.requests[request_id] = RequestState(request_id, prompt_token_ids, params, export_kv=export_kv)

    def end(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End the request in the front (aborted, or ended by the engine: `error`) and forget it; its final output (finish_reason "abort", with `error`: why the engine ended it), or
        None if it was not running."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        return self._output(state, [], None, finished=True, finish_reason="abort", error=error)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def process(self, deltas: list[TokenDelta]) -> ProcessedStep:
        outputs: list[RequestOutput] = []
        ended: dict[str, str] = {}
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue  # aborted or stopped meanwhile
            state.num_preemptions = delta.num_preemptions
            try:
                output = self._advance(state, delta)
            except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer failed on this request alone
                output = self._output(state, [], None, finished=True, finish_reason="error",
                                      error=error_message(exc))
            if output.finished:
                del self.requests[delta.request_id]
                if delta.finish_reason is None:  # ended here (stop string, error): the engine still runs it
                    ended[delta.request_id] = output.finish_reason
            outputs.append(output)
        return ProcessedStep(outputs, ended)

    def _advance(self, state: RequestState, delta: TokenDelta) -> RequestOutput:
        params = state.params
        if delta.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = delta.prompt_logprobs.entries()
        if delta.cached_prompt_tokens is not None:
            state.cached_prompt_tokens = delta.cached_prompt_tokens
        if delta.routed_experts is not None:
            state.routed_rows.append(delta.routed_experts.to_numpy())
        new_tokens: list[int] = []
        new_logprobs: list[TokenLogprob] = []
        for index, token in enumerate(delta.new_token_ids):
            state.token_ids.append(token)
            new_tokens.append(token)
            if state.logprobs is not None and delta.new_logprobs is not None:
                state.logprobs.append(delta.new_logprobs[index])
                new_logprobs.append(delta.new_logprobs[index])
            if self.detokenizer is None:
                continue
            previous_len = len(state.text)
            state.text += self.detokenizer.increment(state.token_ids, state.decode_state)
            if params.stop and len(state.token_ids) >= params.min_tokens:
                match = cut_at_stop(state.text, params.stop, previous_len)
                if match.matched:
                    state.text, state.stop_string = match.text, match.stop
                    return self._output(state, new_tokens, new_logprobs, finished=True, finish_reason="stop",
                                        error=None)
        if delta.finish_reason is not None:
            if delta.finish_reason != "error" and self.detokenizer is not None:
                state.text = self.detokenizer.decode(state.token_ids)  # whole, held-back bytes included
            return self._output(state, new_tokens, new_logprobs, finished=True, finish_reason=delta.finish_reason,
                                error=delta.error)
        return self._output(state, new_tokens, new_logprobs, finished=False, finish_reason=None, error=None)

    def _output(self, state: RequestState, new_tokens: list[int], new_logprobs: list[TokenLogprob] | None,
                finished: bool, finish_reason: str | None, error: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=state.token_ids,
            text=state.text,
            finished=finished,
            finish_reason=finish_reason,
            logprobs=state.logprobs,
            num_preemptions=state.num_preemptions,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs if state.logprobs is not None else None,
            new_text=self._new_text(state, finished),
            error=error,
            prompt_logprobs=state.prompt_logprobs,
            cached_prompt_tokens=state.cached_prompt_tokens,
            stop_string=state.stop_string,
            routed_experts=self._routed_experts(state) if finished else None,
        )

    @staticmethod
    def _routed_experts(state: RequestState):
        """return_routed_experts: rows [0, prompt + generated - 1) joined (the last token was never fed through the
        model; a request a stop string ended here may have rows past its last token: cut); None when not asked or
        when it ended before any row (an abort)."""
        if not state.routed_rows:
            return None
        rows = np.concatenate(state.routed_rows) if len(state.routed_rows) > 1 else state.routed_rows[0]
        return rows[: len(state.prompt_token_ids) + len(state.token_ids) - 1]

    @staticmethod
    def _new_text(state: RequestState, finished: bool) -> str:
        """Text to stream now: never retracted, so undecided endings wait until the request finishes."""
        text = state.text
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - held_back_suffix(text, state.params.stop)]
        elif not text.startswith("".join(state.sent_pieces)):
            return ""  # the whole decode disagrees with what was streamed: nothing can be taken back
        if len(text) <= state.sent_text_len:
            return ""
        new = text[state.sent_text_len:]
        state.sent_text_len = len(text)
        state.sent_pieces.append(new)
        return new
