"""The secret that authenticates every control-plane connection, and the CURVE keys made from it.

A job launched whole by one front on one node gets a fresh random secret per launch; it reaches
the ranks the front spawns through their process arguments and never leaves the machine. Ranks
started elsewhere (other nodes, torchrun) must be given the same secret by the operator: there is
no default, so a job that needs one and has none refuses to start and says how to set it. A guessable
secret (fewer than 32 random bytes' worth, a repeated pattern) or a key file other users can read is refused
too (`shared_secret`).

ZeroMQ's CURVE handshake authenticates both ends before any message is delivered: the front's
key pair and the ranks' key pair are both derived from the secret, and the front's ZAP handler
admits only the ranks' public key. Whoever lacks the secret completes no handshake, so not a
byte they send is ever decoded.
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import zmq

from moe_runtime.security.shared_secret import MAKE_ONE, MIN_KEY_BYTES, read_shared_secret, strength_rule, weakness
from moe_runtime.errors import InvalidRequestError

CONTROL_KEY_ENV = "MOE_RUNTIME_CONTROL_KEY"

HOW_TO_SET = (f"set {CONTROL_KEY_ENV} to the same secret on every node (e.g. `export {CONTROL_KEY_ENV}="
              f"$({MAKE_ONE})`) or pass --control-key-file PATH (a file holding the secret, mode 600)")


class ControlKeyError(InvalidRequestError):
    """No usable shared secret for a job whose ranks start outside the front."""


@dataclass(frozen=True)
class CurveKeyPair:
    public: bytes   # Z85, 40 bytes
    secret: bytes   # Z85, 40 bytes


@dataclass(frozen=True)
class ControlKey:
    secret: bytes

    def __post_init__(self) -> None:
        reason = weakness(self.secret)
        if reason is not None:
            raise ControlKeyError(f"the control key is too easy to guess: {reason}; "
                                  f"{strength_rule('it')} ({HOW_TO_SET})")

    def __repr__(self) -> str:  # never in a log line
        return "ControlKey(<secret>)"

    @classmethod
    def generate(cls) -> "ControlKey":
        """A fresh secret for one launch whose ranks are all the front's own children."""
        return cls(secrets.token_bytes(MIN_KEY_BYTES))

    @classmethod
    def shared(cls, key_file: str | None = None) -> "ControlKey":
        """The operator's secret for ranks started elsewhere: --control-key-file, else $MOE_RUNTIME_CONTROL_KEY."""
        secret = read_shared_secret(
            key_file, "--control-key-file", CONTROL_KEY_ENV, ControlKeyError,
            f"ranks started outside this process (--nnodes > 1, --node-rank, --external-workers, torchrun) "
            f"authenticate with a shared control key, and none is set: {HOW_TO_SET}")
        if not secret:
            raise ControlKeyError(f"--control-key-file {key_file} is empty ({HOW_TO_SET})")
        return cls(secret)

    def curve_pair(self, role: bytes) -> CurveKeyPair:
        """The CURVE key pair of `role` (at most 16 bytes), derived from the secret: every holder of the
        secret derives the same pair, nobody else can."""
        seed = hashlib.blake2b(self.secret, digest_size=32, person=b"moe-control", salt=role.ljust(16, b"\0")).digest()
        secret = zmq.utils.z85.encode(seed)
        return CurveKeyPair(zmq.curve_public(secret), secret)

    def front_pair(self) -> CurveKeyPair:
        return self.curve_pair(b"front")

    def rank_pair(self) -> CurveKeyPair:
        return self.curve_pair(b"rank")
