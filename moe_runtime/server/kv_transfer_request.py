"""`kv_transfer_params` on a completion or chat request: a prefill/decode instance's half of one request.

`{"do_remote_decode": true}` (vLLM's spelling) asks a prefill instance to run the prompt, sample the
first token, park the prompt's KV and answer (not streamed) with `kv_transfer_params`: the handle. A
decode instance given that handle as `kv_transfer_params` pulls the KV and continues the request,
streamed or not. Either way the request has one choice. The handle's shape is checked here; its
signature, expiry, single use and prompt digest by the engine, before anything connects.

The prefill half comes with the client's own `max_tokens` (or none): it is validated as the whole
request (the context, min_tokens: a refusal comes before any prefill) and then runs one token. A
request that generates fewer than 2 tokens (asked so, or a chat prompt that leaves one token of
room) has nothing to continue: it runs whole here and the answer, without a handle, is final.
"""
from __future__ import annotations

import dataclasses

from moe_runtime.disaggregation.kv_transfer.handle import HandleError, KVHandle
from moe_runtime.server.errors import bad_request
from moe_runtime.server.generation import ChoiceSpec
from moe_runtime.server.protocol import SamplingFields

PARAM = "kv_transfer_params"


def with_kv_transfer(request: SamplingFields, specs: list[ChoiceSpec]) -> list[ChoiceSpec]:
    """`specs` with the request's KV transfer role (unchanged without `kv_transfer_params`)."""
    params = request.kv_transfer_params
    if params is None:
        return specs
    if len(specs) != 1:
        raise bad_request(f"{PARAM}: a disaggregated request has exactly one choice (one prompt, n=1)", PARAM)
    if params.get("do_remote_decode") is True:
        if request.stream:
            raise bad_request(f"{PARAM} do_remote_decode: the prefill half is not streamed (stream=false)", PARAM)
        params = specs[0].params
        if params.max_tokens < 2:
            return specs      # its first token is its last: run it whole, answer without a handle
        first_token_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        return [dataclasses.replace(specs[0], params=first_token_only, export_kv=True)]
    try:
        handle = KVHandle.from_json_object(params)
    except HandleError as exc:
        raise bad_request(str(exc), PARAM) from exc
    return [dataclasses.replace(specs[0], import_kv=handle)]
