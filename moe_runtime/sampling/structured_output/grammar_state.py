"""One request's place in its grammar: an xgrammar matcher advanced by every token the request accepts.

The sampler reads it (the next token's bitmask) and never changes it, so a batch can be sampled
again row by row after a failure; the engine core advances it once per sampled token (`accept`),
on every rank alike. The grammar decides where a constrained output ends: once it is complete it
allows only the stop tokens, and accepting one terminates the matcher: the request finishes with
"stop" (even with ignore_eos, which cannot make a finished grammar go on).
"""
from __future__ import annotations

from dataclasses import dataclass

import xgrammar


@dataclass
class GrammarState:
    matcher: xgrammar.GrammarMatcher | None
    error: str | None = None          # why this request's grammar could not be set up (it fails at its first step)

    @classmethod
    def start(cls, compiled: xgrammar.CompiledGrammar) -> "GrammarState":
        # a tokenizer without stop tokens: the matcher ends as soon as the grammar is complete
        no_stops = not compiled.tokenizer_info.stop_token_ids
        return cls(xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=no_stops))

    @classmethod
    def failed(cls, error: str) -> "GrammarState":
        return cls(None, error)

    def accept(self, token_id: int) -> str | None:
        """Advance past `token_id`; None, or why the grammar refused it (the request then fails)."""
        if self.matcher is None:
            return self.error or "structured output is not set up"
        if not self.matcher.accept_token(token_id):
            return f"structured output: token {token_id} does not continue the grammar"
        return None

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()
