"""Compiled grammars for one engine: compiled once per spec, kept in a bounded LRU, shared by every request.

Compiling turns a grammar into token-level masks for this tokenizer (xgrammar's adaptive token mask
cache): about a millisecond for an ordinary schema on a small vocabulary, longer on a large one.
It runs on the rank's compile threads (`GrammarWaits`: the request waits for it, the stepping loop
and the other requests do not), never on the server's event loop. xgrammar's own cache is off: this LRU is the one
bound (entries and bytes) on what compiled grammars hold.

A spec that fails to compile here (the front checked that it parses, so this is rare) does not
raise: the request gets a `GrammarState` that carries the error, and fails alone at its first step.
"""
from __future__ import annotations

import logging
from typing import Iterable

import xgrammar

from moe_runtime.errors import InvalidRequestError, error_message
from moe_runtime.sampling.structured_output.grammar_parsing import parse_grammar, xgrammar_message
from moe_runtime.sampling.structured_output.grammar_state import GrammarState
from moe_runtime.sampling.structured_output.lru import BoundedLRU
from moe_runtime.sampling.structured_output.spec import FIELD, StructuredOutputSpec
from moe_runtime.sampling.structured_output.tokenizer_info import build_tokenizer_info

logger = logging.getLogger(__name__)


class GrammarCompilerCache:
    MAX_ENTRIES = 256
    MAX_BYTES = 512 * 2**20

    def __init__(self, tokenizer_info: xgrammar.TokenizerInfo, max_threads: int = 1,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, any_whitespace: bool = False):
        """`any_whitespace`: JSON specs that do not say may hold whitespace (--structured-output-any-whitespace)."""
        self.tokenizer_info = tokenizer_info
        self.any_whitespace = any_whitespace
        self.vocab_size = tokenizer_info.vocab_size
        self._compiler = xgrammar.GrammarCompiler(tokenizer_info, max_threads=max(1, max_threads),
                                                  cache_enabled=False)
        self._compiled: BoundedLRU[StructuredOutputSpec, xgrammar.CompiledGrammar] = BoundedLRU(
            max_entries, max_bytes, size_of=lambda grammar: grammar.memory_size_bytes)
        self.compilations = 0      # how many times a spec was compiled (cache misses)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                      max_threads: int = 1, any_whitespace: bool = False) -> "GrammarCompilerCache":
        return cls(build_tokenizer_info(tokenizer, vocab_size, stop_token_ids), max_threads,
                   any_whitespace=any_whitespace)

    def compile(self, spec: StructuredOutputSpec) -> xgrammar.CompiledGrammar:
        """The spec's compiled grammar (cached); `InvalidRequestError` naming the field if it cannot be."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            grammar = parse_grammar(spec, self.any_whitespace)
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except Exception as exc:  # noqa: BLE001 - xgrammar's errors are RuntimeErrors of any kind
                raise InvalidRequestError(f"{FIELD}.{spec.kind}: xgrammar could not compile it: "
                                          f"{xgrammar_message(exc)}") from exc
            self.compilations += 1
            self._compiled.put(spec, compiled)
        return compiled

    def new_state(self, spec: StructuredOutputSpec) -> GrammarState:
        """A fresh matcher for one request; never raises (a failure travels in the state)."""
        try:
            return GrammarState.start(self.compile(spec))
        except Exception as exc:  # noqa: BLE001 - fails this request only, at its first step
            logger.warning("structured output for a request could not be compiled: %s", error_message(exc))
            return GrammarState.failed(error_message(exc) if not isinstance(exc, InvalidRequestError) else str(exc))

    def __len__(self) -> int:
        return len(self._compiled)


def build_grammar_compiler(tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                           max_threads: int = 1, any_whitespace: bool = False) -> GrammarCompilerCache | None:
    """An engine's compiler (its TokenizerInfo built now, once), or None without a (usable) tokenizer:
    structured requests then fail alone (the front refuses them first when there is no tokenizer)."""
    if tokenizer is None:
        return None
    try:
        return GrammarCompilerCache.for_tokenizer(tokenizer, vocab_size, stop_token_ids, max_threads, any_whitespace)
    except Exception as exc:  # noqa: BLE001 - an odd tokenizer costs structured output, not the engine
        logger.warning("structured output is unavailable: xgrammar cannot read this tokenizer (%s)",
                       error_message(exc))
        return None

