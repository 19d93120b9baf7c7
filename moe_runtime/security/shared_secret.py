"""What every shared secret of a job must be (the control key, the P/D set's KV transfer key): hard to guess,
and read only from a file nobody else can read.

The rule for strength, checked on the secret as given (environment variable or key file, surrounding whitespace
stripped):

- text of hexadecimal digits only counts as the bytes it spells (`secrets.token_hex(32)`: 64 digits, 32 bytes);
  anything else counts byte for byte (`secrets.token_urlsafe(32)`, raw random bytes);
- it must come to at least 32 bytes, with at least 16 distinct byte values among them, and must not be one
  shorter pattern repeated.

32 random bytes pass with certainty in practice (the chance that they hold fewer than 16 distinct values is below
1e-20); `aaaaaaaaaaaaaaaa`, a 16-byte key, a 40-digit hex key (20 bytes) or `abcd...abcd` do not. No rule can
tell a random string from a carefully made-up one: the error says how to make a random one.
"""
from __future__ import annotations

import os
import stat
import string

MIN_KEY_BYTES = 32
MIN_DISTINCT_BYTES = 16
MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"
HEX_DIGITS = frozenset(string.hexdigits.encode())


def key_material(secret: bytes) -> bytes:
    """The bytes a secret stands for: hex text is decoded (two digits are one byte of randomness at most)."""
    if secret and len(secret) % 2 == 0 and HEX_DIGITS.issuperset(secret):
        return bytes.fromhex(secret.decode())
    return secret


def weakness(secret: bytes) -> str | None:
    """Why `secret` is too easy to guess, or None when it meets the rule above."""
    material = key_material(secret)
    spelled = f" ({len(secret)} hex digits)" if material is not secret else ""
    if len(material) < MIN_KEY_BYTES:
        return f"it is {len(material)} bytes{spelled}, fewer than {MIN_KEY_BYTES}"
    distinct = len(set(material))
    if distinct < MIN_DISTINCT_BYTES:
        return f"it has only {distinct} distinct byte values{spelled}, fewer than {MIN_DISTINCT_BYTES}"
    period = repeating_period(material)
    if period is not None:
        return f"it repeats a {period}-byte pattern{spelled}"
    return None


def repeating_period(material: bytes) -> int | None:
    """The length of a shorter pattern that `material` is made of, repeated (the last copy may be cut), or None."""
    for period in range(1, len(material) // 2 + 1):
        if material[period:] == material[:-period]:
            return period
    return None


def strength_rule(what: str) -> str:
    return (f"{what} must be {MIN_KEY_BYTES} random bytes: {2 * MIN_KEY_BYTES} hex digits (`{MAKE_ONE}`), or at "
            f"least {MIN_KEY_BYTES} other characters with at least {MIN_DISTINCT_BYTES} distinct ones and no repeated "
            f"pattern")


class KeyFileOpenToOthers(Exception):
    """A key file that group or other users may access: its secret may already be theirs."""


def read_private_key_file(path: str, option: str) -> bytes:
    """The stripped contents of the key file `path` (named by the command-line `option`); OSError if it cannot be
    read, KeyFileOpenToOthers when group or other users have any access to it (as ssh refuses such a private
    key file)."""
    descriptor = os.open(os.path.expanduser(path), os.O_RDONLY)
    try:
        mode = stat.S_IMODE(os.fstat(descriptor).st_mode)   # the file read, not whatever the path names later
        if mode & 0o077:
            raise KeyFileOpenToOthers(f"{option} {path} is open to other users (mode {mode:04o}): the secret must be "
                                  f"readable only by you; run `chmod 600 {path}`")
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            return file.read().strip()
    finally:
        os.close(descriptor)


def read_shared_secret(key_file: str | None, option: str, env: str, error: type[Exception], missing: str) -> bytes:
    """A job's secret from the key file `key_file` (the command-line `option`), else from the environment
    variable `env`, stripped; `error(...)` naming the file or the variable when it cannot be had (`missing`: what
    to say when neither holds one). Its strength is the caller's to check (`weakness`)."""
    if key_file:
        try:
            return read_private_key_file(key_file, option)
        except KeyFileOpenToOthers as exc:
            raise error(str(exc)) from None
        except OSError as exc:
            raise error(f"{option} {key_file}: cannot read it ({exc.strerror})") from exc
    secret = os.environ.get(env, "").strip().encode()
    if not secret:
        raise error(missing)
    return secret
