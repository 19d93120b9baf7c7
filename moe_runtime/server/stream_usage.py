"""Which usage a streamed response carries, from `stream_options` (refused without `stream: true`, as
OpenAI and vLLM refuse it).

`include_usage`: one last chunk, with no choices, holds the whole request's usage (OpenAI).
`continuous_usage_stats` (vLLM's extension, honoured together with include_usage as vLLM does): every
chunk also carries the usage so far.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.server.errors import bad_request
from moe_runtime.server.protocol import SamplingFields


@dataclass(frozen=True)
class StreamUsage:
    final: bool = False        # a last chunk with the request's usage
    continuous: bool = False   # the usage so far in every chunk


def stream_usage(request: SamplingFields) -> StreamUsage:
    options = request.stream_options
    if options is None:
        return StreamUsage()
    if not request.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    return StreamUsage(options.include_usage, options.include_usage and options.continuous_usage_stats)
