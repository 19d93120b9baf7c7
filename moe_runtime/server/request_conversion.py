"""From an API request to engine work: the model check, prompt token ids, one `ChoiceSpec` per choice.

Every refusal is an `APIError` naming the parameter at fault. Unknown fields are ignored, each name
warned about once per server (`server.unknown_fields`).

The sampling fields' bounds were checked by the schema (`server.protocol`, from the engine's bounds
table); the `SamplingParams` made here are validated once, by the engine's admission check, when each
choice is submitted. The context-length rule is the engine's too (`check_context_length`): called here
on every prompt, before any choice is submitted, to word a refusal in OpenAI's terms.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from moe_runtime.engine.request_limits import ContextLengthError, check_context_length
from moe_runtime.errors import InvalidRequestError
from moe_runtime.moe.routed_experts import RoutedExpertsArray
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.sampling.structured_output.spec import FIELD, StructuredOutputSpec
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator
from moe_runtime.server.errors import APIError, bad_request
from moe_runtime.server.generation import ChoiceSpec
from moe_runtime.server.chat_reading import ChatReading
from moe_runtime.server.harmony_output import HarmonyFormat
from moe_runtime.server.kv_transfer_request import with_kv_transfer
from moe_runtime.server.prompt_size import PromptSizeBound
from moe_runtime.server.reasoning.prompt_state import PromptReasoning, prompt_reasoning
from moe_runtime.server.reasoning.request_options import thinking_variables
from moe_runtime.server.reasoning.selection import ReasoningChoice
from moe_runtime.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields, digit_keys
from moe_runtime.server.request_work import (chat_logprob_views, check_choices, check_logprobs, check_prompt_tokens,
                                             completion_logprob_views)
from moe_runtime.server.structured_output_request import requested_structure
from moe_runtime.server.tool_calls.fallback_rendering import messages_with_tools_in_text
from moe_runtime.server.tool_calls.parser import ToolCallParser
from moe_runtime.server.tool_calls.plan import ToolCallReader, plan_tool_use
from moe_runtime.server.tool_calls.selection import template_supports_tools
from moe_runtime.server.unknown_fields import UnknownFieldWarnings


@dataclass(frozen=True)
class ModelInfo:
    """What converting a request needs from its server; `build_app` makes one per app, so the
    unknown-field warnings it carries are once per server."""

    served_model_name: str
    max_model_len: int
    tokenizer: object
    tool_call_parser: ToolCallParser | None = None   # reads tool calls for tool_choice auto (None: refused)
    unknown_fields: UnknownFieldWarnings = field(default_factory=UnknownFieldWarnings, compare=False)
    # parses each structured-output spec once per server (in the conversion threads, off the event loop)
    structured_output: StructuredOutputValidator = field(default_factory=StructuredOutputValidator, compare=False)
    harmony: HarmonyFormat | None = None   # chat in harmony (gpt-oss) instead of the chat template
    prompt_size: PromptSizeBound | None = None   # refuses a too-long text before tokenizing it (None: no bound)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's ids of a prompt's text, a text too long for the model refused first (`prompt_size`)."""
        if self.prompt_size is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.prompt_size.encode(self.tokenizer, text, param, add_special_tokens)


def check_model(requested: str | None, model: ModelInfo) -> None:
    if requested is not None and requested != model.served_model_name:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {model.served_model_name!r}",
                       "invalid_request_error", "model", "model_not_found")


def check_supported(request: SamplingFields) -> None:
    for name, value in request.unsupported_settings().items():
        raise bad_request(f"{name}={value!r} is not supported by this server", name, "unsupported_parameter")


def given_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts as given, each a text or token ids (a single prompt is a list of one)."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def completion_prompts(request: CompletionRequest, model: ModelInfo) -> list[list[int]]:
    """The request's prompts as token ids (a single prompt is a list of one)."""
    prompts = given_prompts(request)
    if not prompts:
        raise bad_request("prompt is an empty list: give a string, a list of token ids, or a list of those", "prompt")
    token_ids = []
    for i, one in enumerate(prompts):
        if isinstance(one, str):
            if model.tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
            one = model.encode(one, "prompt")
        if not one:
            raise bad_request(f"prompt {i} is empty", "prompt")
        token_ids.append(list(one))
    return token_ids


def chat_prompt(request: ChatCompletionRequest, model: ModelInfo, tools: list[dict] | None = None) -> list[int]:
    """The conversation rendered with the tokenizer's chat template, ending in the assistant header; with
    `continue_final_message`, inside the last message instead, the assistant's, which the answer continues (a
    prefill: the Messages API's final assistant turn)."""
    prefill = request.continue_final_message
    if prefill and (request.messages[-1].role != "assistant" or model.harmony is not None):
        raise bad_request("continue_final_message continues the last message, which must be the assistant's (and "
                          "a harmony model's answer cannot continue one)", "continue_final_message")
    return render_chat(request.messages, model, tools, add_generation_prompt=not prefill,
                       continue_final_message=prefill, request=request)


def render_chat(messages: list[ChatMessage], model: ModelInfo, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False, request: ChatCompletionRequest | None = None) -> list[int]:
    """Token ids of `messages` through the chat template, with `tools` (OpenAI tool definitions) shown to it.

    A template that does not read tools gets them, and the conversation's tool-call turns, written into
    the messages in the Hermes format (`server.tool_calls.fallback_rendering`); without tools, replayed
    tool calls go to the template as they are. A harmony model (gpt-oss) is rendered in harmony instead
    (`server.harmony_render`); a request's `chat_template_kwargs` reach the template as variables."""
    tokenizer = model.tokenizer
    if model.prompt_size is not None:   # the template adds little: the messages alone must fit
        model.prompt_size.check_chars(sum(len(message.text()) for message in messages), "messages")
    if model.harmony is not None and tokenizer is not None:
        text = model.harmony.render(messages, tools, request, add_generation_prompt)
        return model.encode(text, "messages", add_special_tokens=add_special_tokens)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", "messages", "no_chat_template")
    rendered = [template_message(m) for m in messages]
    if tools and not template_supports_tools(tokenizer.chat_template):
        rendered, tools = messages_with_tools_in_text(rendered, tools), None
    options = template_variables(request, tokenizer.chat_template)
    if tools:
        options["tools"] = tools
    if continue_final_message:
        options["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **options)
    except Exception as exc:  # noqa: BLE001 - the template's own error names what it rejects
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from exc
    return model.encode(text, "messages", add_special_tokens=add_special_tokens)


TEMPLATE_ARGUMENTS = frozenset({"tools", "add_generation_prompt", "continue_final_message", "tokenize", "conversation",
                                "chat_template", "documents", "return_dict", "return_tensors", "tokenizer_kwargs"})


def template_variables(request: ChatCompletionRequest | None, chat_template: object) -> dict:
    """A request's `chat_template_kwargs` (e.g. Qwen3's `enable_thinking`) that the template reads (vLLM passes
    only those too: a variable another model's template would read must not break this one), less the names
    `apply_chat_template` itself takes: the request's tools go through `tool_choice`'s plan, never around it."""
    given = {}
    if request is not None:   # reasoning_effort ("none": thinking off) as the families' variables, the kwargs winning
        given = {**thinking_variables(None, request.reasoning_effort), **(request.chat_template_kwargs or {})}
    template = chat_template if isinstance(chat_template, str) else ""
    return {key: value for key, value in given.items()
            if isinstance(key, str) and key not in TEMPLATE_ARGUMENTS and key in template}


def template_message(message: ChatMessage) -> dict:
    """A message as chat templates take it: text content, plus the tool-call and reasoning fields it carries."""
    rendered = {"role": message.role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        rendered["tool_calls"] = [with_parsed_arguments(call) for call in message.tool_calls]
    reasoning = message.reasoning_content or message.reasoning
    if reasoning:   # templates that keep the last turns' reasoning (Qwen3, DeepSeek-V3.1, GLM) read it so
        rendered["reasoning_content"] = reasoning
    return rendered


def with_parsed_arguments(tool_call: dict) -> dict:
    """OpenAI sends a call's arguments as a JSON string; chat templates expect the object (as vLLM gives them)."""
    function = tool_call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return tool_call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):   # not JSON, or nested past the parser's depth: the template gets the text
        return tool_call
    return {**tool_call, "function": {**function, "arguments": arguments}}


def check_context(prompt_len: int, max_tokens: int, model: ModelInfo, prompt_param: str,
                  max_tokens_param: str) -> None:
    """The engine's context-length rule (`check_context_length`, which admission applies too), its refusal
    worded with the endpoint's parameter names and OpenAI's code `context_length_exceeded`."""
    try:
        check_context_length(prompt_len, max_tokens, model.max_model_len)
    except ContextLengthError as exc:
        if exc.field == "prompt":
            raise bad_request(
                f"{prompt_param} has {prompt_len} tokens, which leaves no room to generate within the model's "
                f"context of {model.max_model_len} tokens", prompt_param, "context_length_exceeded") from exc
        raise bad_request(
            f"{prompt_param} ({prompt_len} tokens) + {max_tokens_param} ({max_tokens}) = {prompt_len + max_tokens} "
            f"exceeds the model's context of {model.max_model_len} tokens", max_tokens_param,
            "context_length_exceeded") from exc


def sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None, seed: int | None,
                    prompt_logprobs: int | None = None, *,
                    structured_output: StructuredOutputSpec | None = None) -> SamplingParams:
    """The request's sampling fields as engine parameters (the schema checked their bounds; the rules that
    relate two fields, min_tokens <= max_tokens among them, are the admission check's)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k in (None, 0) else request.top_k,
        seed=seed,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        min_tokens=request.min_tokens,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        min_p=request.min_p or 0.0,
        logit_bias=digit_keys(request.logit_bias or {}),
        structured_output=structured_output,
        cache_salt=request.cache_salt,   # the app's tenant salt (`server.tenant_salt`) already applied
        return_routed_experts=request.return_routed_experts,
        forced_routed_experts=forced_routing(request),
    )


def forced_routing(request: SamplingFields) -> RoutedExpertsArray | None:
    """The request's `forced_routed_experts` in the engine's form (admission checks its shape and ids)."""
    if request.forced_routed_experts is None:
        return None
    try:
        return request.forced_routed_experts.to_array()
    except ValueError as exc:
        raise bad_request(f"forced_routed_experts: {exc}", "forced_routed_experts") from None


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a prompt: seed + choice, wrapped into [0, 2**63) so that a seed near
    the top stays valid (choice 0 keeps the request's seed as given: an invalid one is refused, not wrapped)."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice) % SamplingParams.SEED_LIMIT


def choice_specs(request: SamplingFields, prompts: list[list[int]], max_tokens: int,
                 logprobs: int | None, prompt_logprobs: int | None = None,
                 prompt_texts: list[str] | None = None, *,
                 structured_output: StructuredOutputSpec | None = None) -> list[ChoiceSpec]:
    """n choices per prompt; with a seed, choice j of a prompt uses `choice_seed` (reproducible, distinct).

    The request's parameters are converted once and the choices differ only in their seed: they share the
    stop strings, stop token ids and logit_bias mapping (which nothing changes), so a 1,024-entry logit_bias
    is one mapping however many choices there are."""
    shared = sampling_params(request, max_tokens, logprobs, request.seed, prompt_logprobs,
                             structured_output=structured_output)
    specs = []
    for prompt_index, prompt in enumerate(prompts):
        for j in range(request.n):
            params = dataclasses.replace(shared, seed=choice_seed(request.seed, j))
            index = prompt_index * request.n + j
            text = prompt_texts[prompt_index] if prompt_texts is not None else ""
            specs.append(ChoiceSpec(index, prompt_index, prompt, params, text))
    return specs


def engine_prompt_logprobs(request: CompletionRequest, max_tokens: int) -> int | None:
    """How many alternatives per prompt token the engine computes for a completion: enough for vLLM's
    `prompt_logprobs` and for an echo's logprobs (the echoed tokens carry theirs, as generated ones do).
    An echo with max_tokens 0 and no logprobs still scores the prompt (0): the engine's prompt-only request."""
    asked = [n for n in (request.prompt_logprobs, request.logprobs if request.echo else None) if n is not None]
    if asked:
        return max(asked)
    return 0 if max_tokens == 0 else None


def echo_texts(request: CompletionRequest, model: ModelInfo) -> list[str] | None:
    """What an echo shows of each prompt: a text prompt as given, token ids decoded (None without echo)."""
    if not request.echo:
        return None
    texts = []
    for prompt in given_prompts(request):
        if isinstance(prompt, str):
            texts.append(prompt)
        else:
            texts.append(model.tokenizer.decode(prompt) if model.tokenizer is not None else "")
    return texts


def completion_choices(request: CompletionRequest, model: ModelInfo) -> list[ChoiceSpec]:
    model.unknown_fields.warn_new(request, "/v1/completions")
    check_model(request.model, model)
    check_supported(request)
    check_choices(len(given_prompts(request)), request.n, len(request.logit_bias or {}))
    prompts = completion_prompts(request, model)
    max_tokens = 16 if request.max_tokens is None else request.max_tokens
    if max_tokens == 0 and not request.echo and request.prompt_logprobs is None:
        raise bad_request("max_tokens=0 generates nothing: it needs echo=true or prompt_logprobs (to score the "
                          "prompt)", "max_tokens")
    for prompt in prompts:
        check_context(len(prompt), max_tokens, model, "prompt", "max_tokens")
    lengths = [len(prompt) for prompt in prompts]
    check_prompt_tokens(lengths, request.n)
    check_logprobs(completion_logprob_views(lengths, max_tokens, request.logprobs, request.prompt_logprobs,
                                            request.echo), request.n)
    structure = requested_structure(request, model.structured_output)
    return with_kv_transfer(request, choice_specs(request, prompts, max_tokens, request.logprobs,
                                                  engine_prompt_logprobs(request, max_tokens),
                                                  echo_texts(request, model), structured_output=structure))


@dataclass(frozen=True)
class ChatConversion:
    choices: list[ChoiceSpec]
    tool_calls: ToolCallReader | None   # reads each choice's tool calls (None: plain content)
    prompt_reasoning: PromptReasoning = PromptReasoning.UNSAID   # where the prompt left the reasoning block

    def reading(self, reasoning: ReasoningChoice, harmony: HarmonyFormat | None) -> ChatReading:
        """How each choice's text is read: its tool calls, and its reasoning by the served model's parser."""
        return ChatReading(self.tool_calls, reasoning.parser, harmony, self.prompt_reasoning)


def chat_choices(request: ChatCompletionRequest, model: ModelInfo) -> ChatConversion:
    model.unknown_fields.warn_new(request, "/v1/chat/completions")
    check_model(request.model, model)
    check_supported(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    check_choices(1, request.n, len(request.logit_bias or {}), "messages")
    tool_use = plan_tool_use(request, model.tool_call_parser)
    prompt = chat_prompt(request, model, tool_use.template_tools)
    asked = request.max_completion_tokens or request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    max_tokens = asked if asked is not None else max(model.max_model_len - len(prompt), 1)
    check_context(len(prompt), max_tokens, model, "messages", param)
    check_prompt_tokens([len(prompt)], request.n, "messages")
    check_logprobs(chat_logprob_views(request.logprobs, request.top_logprobs, max_tokens,
                                      param if asked is not None else f"{param}, by default the rest of the context"),
                   request.n)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    structure = requested_structure(request, model.structured_output)
    specs = choice_specs(request, [prompt], max_tokens, logprobs, structured_output=structure)
    if model.harmony is not None:   # the answer ends at <|return|> or <|call|>
        stops = model.harmony.stop_token_ids()
        specs = [dataclasses.replace(spec, params=dataclasses.replace(
            spec.params, stop_token_ids=list(dict.fromkeys(spec.params.stop_token_ids + stops)))) for spec in specs]
    if tool_use.forced_schema is not None:
        if structure is not None:  # guided_json, structured_outputs, ...: one schema per answer
            raise bad_request(f"tool_choice={request.tool_choice!r} forces the answer into tool calls, which cannot "
                              f"be combined with a structured-output request", "tool_choice")
        forced = StructuredOutputSpec(json_schema=tool_use.forced_schema)
        try:   # here, off the event loop, naming the field (admission would check it again, from the cache)
            model.structured_output.check(forced)
        except InvalidRequestError as exc:
            why = str(exc).removeprefix(f"{FIELD}.json_schema: ")
            raise bad_request(f"the tools' parameter schemas cannot force the call: {why}", "tools") from exc
        specs = [dataclasses.replace(spec, params=dataclasses.replace(spec.params, structured_output=forced))
                 for spec in specs]
    return ChatConversion(with_kv_transfer(request, specs), tool_use.reader,
                          prompt_reasoning(model.tokenizer, prompt))
