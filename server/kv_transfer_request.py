"""`kv_transfer_params` on a completion or chat request: a prefill/decode instance's half of one request.

`{"do_remote_decode": true}` (vLLM's spelling) asks a prefill instance to run the prompt, sample the
first token, park the prompt's KV and answer (not streamed) with `kv_transfer_params`: the handle. A
decode instance given that handle as `kv_transfer_params` pulls the KV and continues the request,
streamed or not. Either way the request has one choice. The handle's shape is checked here; its
signature and prompt digest by the engine, before anything connects.
"""
from __future__ import annotations

import dataclasses

from moe_runtime.disaggregation.kv_transfer.handle import HandleError, KVHandle
from server.errors import bad_request
from server.generation import ChoiceSpec
from server.protocol import SamplingFields

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
        return [dataclasses.replace(specs[0], export_kv=True)]
    try:
        handle = KVHandle.from_json_object(params)
    except HandleError as exc:
        raise bad_request(str(exc), PARAM) from exc
    return [dataclasses.replace(specs[0], import_kv=handle)]
