"""The secret shared by the instances of one prefill/decode deployment, and what is made from it.

KV blocks cross between instances, usually between machines: every KV socket is authenticated
by ZeroMQ's CURVE handshake before a byte of payload is read (the prefill side's ZAP handler
admits only the decode side's public key), with both key pairs derived from this secret exactly as
the control plane derives its own (`attention_dp.control_key`), under other roles. Handles that
travel through the router (and so through HTTP clients' hands) carry a MAC made with the same
secret: a decode instance connects only where a prefill instance of its deployment said to.

Every process that needs the secret reads it where the front does (the key file or the environment variable; the
ranks a front spawns get it with their process arguments, as the control key): it never travels inside another
secret's channel, so a holder of the control key learns nothing of this one. The same strength and key-file rules
apply (`attention_dp.shared_secret`).
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from moe_runtime.security.control_key import ControlKey, CurveKeyPair
from moe_runtime.security.shared_secret import MAKE_ONE, read_shared_secret, strength_rule, weakness
from moe_runtime.errors import InvalidRequestError

KV_KEY_ENV = "MOE_RUNTIME_KV_KEY"

HOW_TO_SET = (f"set {KV_KEY_ENV} to the same secret for every prefill and decode instance (e.g. `export "
              f"{KV_KEY_ENV}=$({MAKE_ONE})`) or pass --kv-transfer-key-file PATH (a file holding the secret, "
              f"mode 600, at that path on every node); "
              f"`moe-serve --pd P:D` makes one for the set it starts")


class TransferKeyError(InvalidRequestError):
    """No usable shared secret for an instance that moves KV blocks to or from other instances."""


@dataclass(frozen=True)
class TransferKey:
    key: ControlKey

    def __repr__(self) -> str:  # never in a log line
        return "TransferKey(<secret>)"

    @classmethod
    def from_secret(cls, secret: bytes) -> "TransferKey":
        reason = weakness(secret)
        if reason is not None:
            raise TransferKeyError(f"the KV transfer key is too easy to guess: {reason}; "
                                   f"{strength_rule('it')} ({HOW_TO_SET})")
        return cls(ControlKey(secret))

    @classmethod
    def shared(cls, key_file: str | None = None) -> "TransferKey":
        """--kv-transfer-key-file, else $MOE_RUNTIME_KV_KEY; there is no default (an error says how to set one)."""
        return cls.from_secret(read_shared_secret(
            key_file, "--kv-transfer-key-file", KV_KEY_ENV, TransferKeyError,
            f"--disaggregation-mode prefill|decode moves KV blocks between instances, which authenticate with a "
            f"shared key, and none is set: {HOW_TO_SET}"))

    def server_pair(self) -> CurveKeyPair:
        """The prefill side's sockets (KV block servers, the release listener) serve with this pair."""
        return self.key.curve_pair(b"kv-server")

    def client_pair(self) -> CurveKeyPair:
        """The decode side's sockets connect with this pair; the servers admit only its public key."""
        return self.key.curve_pair(b"kv-client")

    def mac(self, payload: bytes) -> str:
        """A MAC of `payload` (hex): only holders of the secret can make one."""
        return hashlib.blake2b(payload, key=self.key.secret[:64], digest_size=32, person=b"moe-kv-handle").hexdigest()

    def verify(self, payload: bytes, mac: str) -> bool:
        return hmac.compare_digest(self.mac(payload), mac)
