"""`KVHandle`: what a prefill instance hands out for a parked request, and a decode instance takes in.

It says where the request's KV blocks are (each prefill rank's `KVShard`: block server, layers,
heads), how many tokens they hold, the first token sampled after the prompt (with its logprob
when asked for) and where to send the release (a seeded request needs no sampler state: its draws
are keyed by seed and position, so the decode instance draws what one instance would have). It
travels as JSON through the router in `kv_transfer_params`, so every field is signed (the logprob's
floats too: JSON carries a finite float exactly, as its shortest round-trip repr): the decode side
checks the MAC before connecting anywhere, and checks the prompt's digest against the prompt it
tokenized itself. It is good for one import before `expires_at` (the prefill frees the parked
blocks at its transfer timeout anyway): its random `nonce` is what the decode side remembers
(`used_nonces.UsedNonces`) to refuse a second use.
"""
from __future__ import annotations

import hashlib
import secrets
import time
from typing import Annotated

import msgspec

from moe_runtime.sampling.logprobs import TokenLogprob
from moe_runtime.errors import InvalidRequestError
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.messages import RequestId
from moe_runtime.disaggregation.kv_transfer.shard import Count, Endpoint, KVShard

MAX_SHARDS = 1024            # ranks of one prefill DP worker (attention TP x pipeline stages)
MAX_TOP_LOGPROBS = 1024
MAX_DRAFTS = 64              # drafts after the first token (a model drafter's num_speculative_tokens)
NONCE_HEX_CHARS = 32          # 128 random bits


class HandleError(InvalidRequestError):
    """A handle that is not one this deployment's prefill instances made, or does not fit the request."""


class HandleLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token_id: Count
    logprob: float
    top_ids: Annotated[list[Count], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)]
    top_logprobs: Annotated[list[float], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)]

    @classmethod
    def of(cls, logprob: TokenLogprob) -> "HandleLogprob":
        return cls(token_id=logprob.token_id, logprob=logprob.logprob, top_ids=list(logprob.top),
                   top_logprobs=list(logprob.top.values()))

    def token_logprob(self) -> TokenLogprob:
        return TokenLogprob(self.token_id, self.logprob, dict(zip(self.top_ids, self.top_logprobs)))


class KVHandle(msgspec.Struct, frozen=True, kw_only=True):
    request_id: RequestId                 # the request's id on the prefill instance
    num_tokens: Count                     # tokens whose KV is parked: the prompt
    prompt_digest: Annotated[str, msgspec.Meta(max_length=64)]
    first_token: Count
    first_logprob: HandleLogprob | None = None
    # the prefill's model drafter's drafts after the first token (MTP, EAGLE-3; `disaggregation/draft_layer.py`)
    first_drafts: Annotated[list[Count], msgspec.Meta(max_length=MAX_DRAFTS)] = []
    shards: Annotated[list[KVShard], msgspec.Meta(min_length=1, max_length=MAX_SHARDS)]
    release_endpoint: Endpoint
    nonce: Annotated[str, msgspec.Meta(min_length=NONCE_HEX_CHARS, max_length=NONCE_HEX_CHARS,
                                       pattern="^[0-9a-f]+$")]
    expires_at: float                     # time.time() on the prefill instance when its parked copy is freed
    mac: Annotated[str, msgspec.Meta(max_length=128)] = ""

    def first_token_logprob(self) -> TokenLogprob | None:
        return self.first_logprob.token_logprob() if self.first_logprob is not None else None

    @staticmethod
    def new_nonce() -> str:
        return secrets.token_hex(NONCE_HEX_CHARS // 2)

    def signed(self, key: TransferKey) -> "KVHandle":
        return msgspec.structs.replace(self, mac=key.mac(self._signed_bytes()))

    def authentic(self, key: TransferKey, now: float | None = None) -> "KVHandle":
        """This handle, if `key` signed it (every field) and it has not expired; else `HandleError`."""
        if not key.verify(self._signed_bytes(), self.mac):
            raise HandleError("kv_transfer_params was not made by a prefill instance of this deployment "
                              "(bad signature)")
        now = time.time() if now is None else now
        if self.expires_at <= now:
            raise HandleError(f"kv_transfer_params expired {now - self.expires_at:.1f}s ago (the prefill instance "
                              f"freed its KV at its --kv-transfer-timeout; if this is far off, check both clocks)")
        return self

    def check_prompt(self, prompt_token_ids: list[int]) -> "KVHandle":
        """This handle, if it is for `prompt_token_ids`; else `HandleError`."""
        if self.num_tokens != len(prompt_token_ids) or self.prompt_digest != prompt_digest(prompt_token_ids):
            raise HandleError("kv_transfer_params belongs to another prompt than this request's")
        return self

    def verified(self, key: TransferKey, prompt_token_ids: list[int]) -> "KVHandle":
        """This handle, if `key` signed it, it has not expired and it is for `prompt_token_ids`; else
        `HandleError`. (Whether it was used already is the decode front's to know.)"""
        return self.authentic(key).check_prompt(prompt_token_ids)

    def _signed_bytes(self) -> bytes:
        """Every field but the MAC."""
        return msgspec.msgpack.encode(msgspec.structs.replace(self, mac=""))

    def to_json_object(self) -> dict:
        return msgspec.to_builtins(self)

    @classmethod
    def from_json_object(cls, value: object) -> "KVHandle":
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise HandleError(f"kv_transfer_params is not a KV handle: {exc}") from exc


def prompt_digest(prompt_token_ids: list[int]) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(list(prompt_token_ids))).hexdigest()
