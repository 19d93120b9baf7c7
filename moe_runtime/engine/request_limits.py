"""The checks every engine applies to a new request, before it is queued anywhere: the admission check.

`RequestLimits.check` is where a request is validated, once: its sampling parameters against the bounds
table (`SamplingParams.validate`, which nothing else calls), then what needs the model. The front calls
it once per request; the ranks trust what the front admitted.

The context-length rule is `check_context_length`; the server calls the same function before it
submits an API call's choices, only to word the refusal in OpenAI's terms (`ContextLengthError` carries
the numbers; the endpoint names its own parameters) and to refuse every choice of a call together.

Structured output is checked here too: the spec must parse in xgrammar (`StructuredOutputValidator`,
cached per spec), so a bad schema, regex or grammar is refused at admission, naming the field, and
the ranks only ever compile specs that parse.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.errors import InvalidRequestError
from moe_runtime.moe.routed_experts import RoutingShape, check_routed_experts
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator


class ContextLengthError(InvalidRequestError):
    """prompt + max_tokens does not fit the model's context. `field` is the one at fault: "prompt" when the
    prompt alone fills the context, else "max_tokens"."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int):
        total = prompt_tokens + max_tokens
        super().__init__(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                         f"max_model_len {max_model_len}")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.field = "prompt" if prompt_tokens >= max_model_len else "max_tokens"


def check_context_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt and the tokens to generate must fit the model's context (raises `ContextLengthError`)."""
    if prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(prompt_tokens, max_tokens, max_model_len)


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int       # one DP worker's KV cache
    has_tokenizer: bool = True
    routing: RoutingShape | None = None   # the model's MoE routing (routing replay's arrays); None: not known
    structured_output: StructuredOutputValidator = field(default_factory=StructuredOutputValidator, compare=False,
                                                         repr=False)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()  # the request's one validation (construction checks nothing; the ranks trust this)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:   # C loops: 128k ids in ~2 ms
            bad = next(t for t in prompt_token_ids if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        check_context_length(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        self._check_routing(params, len(prompt_token_ids) + params.max_tokens)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.kv_capacity_tokens:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache of a DP worker "
                f"({self.kv_capacity_tokens} tokens); raise kv_cache_memory"
            )
        outside = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(f"SamplingParams.stop_token_ids=[{outside[0]}, ...]: token id {outside[0]} is "
                                      f"outside the vocabulary [0, {self.vocab_size})")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(f"SamplingParams.logprobs={params.logprobs}: more than the vocabulary "
                                      f"({self.vocab_size} tokens)")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.vocab_size:
            raise InvalidRequestError(f"SamplingParams.prompt_logprobs={params.prompt_logprobs}: more than the "
                                      f"vocabulary ({self.vocab_size} tokens)")
        if params.stop and not self.has_tokenizer:
            raise InvalidRequestError("stop strings need a tokenizer, and the checkpoint has none")
        outside = [t for t in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(f"SamplingParams.logit_bias={{{outside[0]}: ...}}: token id {outside[0]} is "
                                      f"outside the vocabulary [0, {self.vocab_size})")
        if params.structured_output is not None:
            if not self.has_tokenizer:
                raise InvalidRequestError("SamplingParams.structured_output: needs a tokenizer (a grammar is matched "
                                          "against token text), and the checkpoint has none")
            self.structured_output.check(params.structured_output)

    def _check_routing(self, params: SamplingParams, max_positions: int) -> None:
        """Routing replay needs an MoE model; a forced array must fit it (`check_routed_experts`)."""
        if not params.return_routed_experts and params.forced_routed_experts is None:
            return
        name = "return_routed_experts" if params.return_routed_experts else "forced_routed_experts"
        if self.routing is None or self.routing.num_moe_layers == 0:
            raise InvalidRequestError(f"SamplingParams.{name}: this model has no MoE layers to route")
        if self.routing.refusal is not None:
            raise InvalidRequestError(f"SamplingParams.{name}: {self.routing.refusal}")
        if params.forced_routed_experts is not None:
            check_routed_experts(params.forced_routed_experts, self.routing, max_positions)
