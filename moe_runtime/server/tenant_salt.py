"""Tenants' prefix caches kept apart: the `cache_salt` a request runs with.

A cached prefix answers its first token much sooner than a computed one (72 ms vs 505 ms for 1,024
tokens), so whoever shares a prefix cache with others can test guesses of their prompts. The engine
shares KV blocks only between requests of the same `cache_salt` (it roots the blocks' hash chain:
`moe_runtime.kv_blocks.prefix_hash.chain_root`).

- No key or one key: one tenant. A request's own `cache_salt` (vLLM's field) is used as given, and
  requests without one share a cache, as before.
- Several keys (`build_app(api_key=[...])`): each key is a tenant. Its requests run with a salt derived
  from the key's identity (its index, `server.auth.KEY_INDEX_STATE`) and the request's own salt, if any:
  an HMAC under a secret drawn per app, so a salt is never the key, cannot be guessed from the key's
  index, and no request of another key can name it, whatever `cache_salt` it sends.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from fastapi import Request

from moe_runtime.server.auth import KEY_INDEX_STATE, ApiKeys
from moe_runtime.server.protocol import SamplingFields


@dataclass(frozen=True)
class TenantSalts:
    per_key: bool                                       # several keys: every key's requests get a salt of their own
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    @classmethod
    def for_keys(cls, keys: ApiKeys | None) -> "TenantSalts":
        return cls(per_key=keys is not None and keys.several)

    def salt(self, key_index: int | None, client_salt: str | None) -> str | None:
        """The salt a request runs with: the client's, or with several keys one of its key's own."""
        if not self.per_key or key_index is None:
            return client_salt
        message = f"key {key_index}\0{client_salt or ''}".encode()   # client salts are non-empty: None != ""
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def salted(self, body: SamplingFields, request: Request) -> SamplingFields:
        """`body` with the `cache_salt` it runs with (its key identity read from the request's state)."""
        salt = self.salt(getattr(request.state, KEY_INDEX_STATE, None), body.cache_salt)
        return body if salt == body.cache_salt else body.model_copy(update={"cache_salt": salt})
