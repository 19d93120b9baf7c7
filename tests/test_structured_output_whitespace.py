"""JSON structured output is compact unless asked otherwise (xgrammar any_whitespace=False, vLLM's
disable-any-whitespace): no whitespace token is allowed between elements, so a weak model cannot spend its
max_tokens on whitespace; a spec, the engine flag or a request's `structured_outputs.disable_any_whitespace`
allows it (bounded run)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from engine_helpers import PROMPTS
from moe_runtime import LLM, SamplingParams
from moe_runtime.sampling.structured_output.compiler import GrammarCompilerCache
from moe_runtime.sampling.structured_output.grammar_bitmask import GrammarBitmask
from moe_runtime.sampling.structured_output.grammar_state import GrammarState
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator
from moe_runtime.server.protocol import ChatCompletionRequest
from moe_runtime.server.structured_output_request import requested_structure

pytestmark = pytest.mark.timeout(300)

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array",
                     "items": {"type": "boolean"}}}, "required": ["a", "b"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)


def whitespace_allowed_after(compiler: GrammarCompilerCache, spec: StructuredOutputSpec, text: str, tokenizer) -> bool:
    state = GrammarState.start(compiler.compile(spec))
    assert state.matcher.accept_string(text)
    logits = torch.zeros(1, compiler.vocab_size)
    GrammarBitmask().apply(logits, [0], [state])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    return any(tokenizer.decode([t]).strip() == "" and tokenizer.decode([t]) != "" for t in allowed)


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_json_is_compact_by_default_and_whitespace_is_an_option(tokenizer, kind):
    spec = (dict(json_schema=SCHEMA) if kind == "json_schema" else dict(json_object=True))
    compact = GrammarCompilerCache.for_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spacious = GrammarCompilerCache.for_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                                                  any_whitespace=True)   # --structured-output-any-whitespace
    for prefix in ("{", '{"a":1,'):
        if kind == "json_object" and prefix != "{":
            continue
        assert not whitespace_allowed_after(compact, StructuredOutputSpec(**spec), prefix, tokenizer)
        assert whitespace_allowed_after(compact, StructuredOutputSpec(**spec, any_whitespace=True), prefix, tokenizer)
        assert whitespace_allowed_after(spacious, StructuredOutputSpec(**spec), prefix, tokenizer)
        assert not whitespace_allowed_after(spacious, StructuredOutputSpec(**spec, any_whitespace=False), prefix,
                                            tokenizer)


def test_sampled_json_on_the_tiny_model_is_compact(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu") as llm:
        outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=80, temperature=1.0, seed=i,
                                                     structured_output=StructuredOutputSpec(json_schema=SCHEMA))
                                      for i in range(len(PROMPTS))])
    for out in outs:
        if out.finish_reason == "stop":
            assert out.text == json.dumps(json.loads(out.text), separators=(",", ":"), ensure_ascii=False)
        else:
            assert not any(c.isspace() for c in out.text), out.text   # no strings in SCHEMA: no space at all


@pytest.mark.parametrize("disable, expected", [(None, None), (True, False), (False, True)])
def test_the_request_field_is_vllms_disable_any_whitespace(disable, expected):
    outputs = {"json": {"type": "object"}} | ({} if disable is None else {"disable_any_whitespace": disable})
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], structured_outputs=outputs)
    spec = requested_structure(request, StructuredOutputValidator())
    assert spec.any_whitespace is expected


def test_any_whitespace_must_be_a_flag():
    with pytest.raises(ValueError, match=r"structured_output\.any_whitespace"):
        StructuredOutputSpec(json_object=True, any_whitespace="yes")
