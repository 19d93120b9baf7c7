"""`ImportSpec`: a request prefilled on a prefill instance, as a decode front hands it to its ranks.

A plain dataclass of numbers, strings and lists (and the prefill ranks' `KVShard` structs): it
travels in the control plane's `ImportRequest`, decoded field by field by msgspec.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.sampling.params import SamplingParams


@dataclass
class ImportSpec:
    """A request prefilled elsewhere, as the decode front sends it to its ranks (a plain dataclass: msgspec)."""

    request_id: str                         # on this instance
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: int
    source_request_id: str                  # on the prefill instance
    shards: list[KVShard]                   # the prefilling worker's ranks
    first_logprob: TokenLogprob | None = None
    first_drafts: list[int] = field(default_factory=list)   # the prefill's model drafter's, after first_token
