"""The checks every engine applies to a new request, before it is queued anywhere.

Structured output is checked here too: the spec must parse in xgrammar (`StructuredOutputValidator`,
cached per spec), so a bad schema, regex or grammar is refused at admission, naming the field, and
the ranks only ever compile specs that parse.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int       # one DP worker's KV cache
    has_tokenizer: bool = True
    structured_output: StructuredOutputValidator = field(default_factory=StructuredOutputValidator, compare=False,
                                                         repr=False)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()  # again: a caller may have changed the fields since they were checked at construction
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len}"
            )
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
