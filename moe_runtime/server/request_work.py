"""What one API call asks of the engine and of its response, counted and refused before anything is built.

The server turns a request into prompts x n engine requests, each with the whole prompt, its own copy of
the sampling state in the engine, and its share of the response: a small body can ask for a great deal
(2,000 prompts x n=64 with a 1,024-entry logit_bias is 22 KB; prompt_logprobs=20 on a 2,000-token prompt
with n=64 is 8 KB and a 180 MB response). The products are bounded by the table's `WORK_BOUNDS`
(`moe_runtime.sampling.bounds`); a request over one is a 400 that names the fields to lower.

`check_choices` needs only the request (it runs before the prompts are tokenized), the others the prompts'
token counts (they run before any choice is built or submitted).
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.sampling.bounds import WORK_BOUND
from moe_runtime.server.errors import bad_request

REFUSAL_CODE = "request_too_large"


def _refuse(bound_name: str, amount: int, how: str, lower: str, param: str):
    bound = WORK_BOUND[bound_name]
    return bad_request(f"{how} = {amount:,} {bound.counted}, at most {bound.hi:,} per request: lower {lower}",
                       param, REFUSAL_CODE)


def _multiplier_param(num_prompts: int, n: int, prompt_param: str) -> str:
    """The field a refusal names: n when it multiplies, else the prompts."""
    return "n" if n > 1 or num_prompts == 1 else prompt_param


def check_choices(num_prompts: int, n: int, logit_bias_entries: int, prompt_param: str = "prompt") -> None:
    """prompts x n choices, and logit_bias entries x choices, inside the table's bounds."""
    choices = num_prompts * n
    if WORK_BOUND["choices"].exceeded_by(choices):
        raise _refuse("choices", choices, f"{num_prompts} prompts x n={n}", "n or the number of prompts",
                      _multiplier_param(num_prompts, n, prompt_param))
    entries = logit_bias_entries * choices
    if WORK_BOUND["logit_bias"].exceeded_by(entries):
        raise _refuse("logit_bias", entries, f"{logit_bias_entries} logit_bias entries x {choices} choices",
                      "logit_bias, n or the number of prompts", "logit_bias")


def check_prompt_tokens(prompt_lengths: list[int], n: int, prompt_param: str = "prompt") -> None:
    """Every choice admits its whole prompt: the prompts' tokens x n inside the table's bound."""
    tokens = sum(prompt_lengths) * n
    if WORK_BOUND["prompt_tokens"].exceeded_by(tokens):
        raise _refuse("prompt_tokens", tokens, f"{sum(prompt_lengths):,} prompt tokens x n={n}",
                      f"n or the {prompt_param}", _multiplier_param(len(prompt_lengths), n, prompt_param))


@dataclass(frozen=True)
class LogprobView:
    """One place a response shows logprobs: `positions` tokens (over all prompts, per choice), each with
    `alternatives` + 1 entries (the token itself and its top alternatives), asked for by `param`."""

    param: str
    alternatives: int
    positions: int
    where: str            # "prompt tokens", "generated tokens (max_tokens x prompts)"

    @property
    def entries(self) -> int:
        return self.positions * (self.alternatives + 1)


def check_logprobs(views: list[LogprobView], n: int) -> None:
    """The response's logprob entries over every view, times n, inside the table's bound; the refusal names
    the view that contributes most."""
    total = sum(view.entries for view in views) * n
    if not views or not WORK_BOUND["logprobs"].exceeded_by(total):
        return
    largest = max(views, key=lambda view: view.entries)
    how = " + ".join(f"{view.param}: {view.positions:,} {view.where} x ({view.alternatives} + 1)" for view in views)
    raise _refuse("logprobs", total, f"({how}) x n={n}", f"{largest.param}, n or the tokens it covers",
                  largest.param)


def completion_logprob_views(prompt_lengths: list[int], max_tokens: int, logprobs: int | None,
                             prompt_logprobs: int | None, echo: bool) -> list[LogprobView]:
    """/v1/completions shows logprobs in up to three places: vLLM's prompt_logprobs, an echoed prompt's
    logprobs, the generated tokens' logprobs."""
    prompt_tokens = sum(prompt_lengths)
    views = []
    if prompt_logprobs is not None:
        views.append(LogprobView("prompt_logprobs", prompt_logprobs, prompt_tokens, "prompt tokens"))
    if logprobs is not None and echo:
        views.append(LogprobView("logprobs", logprobs, prompt_tokens, "echoed prompt tokens"))
    if logprobs is not None:
        views.append(LogprobView("logprobs", logprobs, max_tokens * len(prompt_lengths),
                                 "generated tokens (max_tokens x prompts)"))
    return views


def chat_logprob_views(logprobs: bool, top_logprobs: int | None, max_tokens: int,
                       max_tokens_param: str) -> list[LogprobView]:
    """/v1/chat/completions shows the generated tokens' logprobs (with logprobs=true); `max_tokens_param` names
    the field max_tokens came from (a default: the rest of the context)."""
    if not logprobs:
        return []
    param = "top_logprobs" if top_logprobs else "logprobs"
    return [LogprobView(param, top_logprobs or 0, max_tokens, f"generated tokens ({max_tokens_param})")]
