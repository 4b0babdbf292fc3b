"""API key format, generation, hashing and constant-time verification.

A key reads ``tg-<8 lowercase letters/digits>_<43 urlsafe characters>``: the part up to the
underscore is a public lookup prefix (shown in listings, stored as is); the rest is 32 bytes
from the CSPRNG. The database keeps only the prefix and the SHA-256 of the whole key. Keys
carry 256 bits of entropy, so a fast hash is enough: there is nothing to brute-force.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

KEY_PREFIX = "tg-"
LOOKUP_ID_LENGTH = 8
SECRET_NUM_BYTES = 32
_LOOKUP_ALPHABET = string.ascii_lowercase + string.digits
_SEPARATOR = "_"
# "tg-" + lookup id: the stored, public part of a key.
PREFIX_LENGTH = len(KEY_PREFIX) + LOOKUP_ID_LENGTH


@dataclass(frozen=True)
class GeneratedKey:
    """A freshly generated key; plaintext is shown to its owner once and then dropped."""

    # The whole key, to hand to the tenant; never stored or logged.
    plaintext: str
    # "tg-" + lookup id; stored and shown in listings.
    prefix: str
    # SHA-256 hex digest of plaintext; stored.
    key_hash: str


def generate_key() -> GeneratedKey:
    lookup_id = "".join(secrets.choice(_LOOKUP_ALPHABET) for _ in range(LOOKUP_ID_LENGTH))
    prefix = KEY_PREFIX + lookup_id
    plaintext = prefix + _SEPARATOR + secrets.token_urlsafe(SECRET_NUM_BYTES)
    return GeneratedKey(plaintext=plaintext, prefix=prefix, key_hash=hash_key(plaintext))


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def lookup_prefix(plaintext: str) -> str | None:
    """The stored prefix of a well-formed key, or None when it cannot be one of ours."""
    if not plaintext.startswith(KEY_PREFIX) or len(plaintext) <= PREFIX_LENGTH + 1:
        return None
    prefix, separator = plaintext[:PREFIX_LENGTH], plaintext[PREFIX_LENGTH]
    lookup_id = prefix[len(KEY_PREFIX) :]
    if separator != _SEPARATOR or any(c not in _LOOKUP_ALPHABET for c in lookup_id):
        return None
    return prefix


def looks_like_key(value: str) -> bool:
    """True for anything shaped like a tenant key (used to keep tenant keys off admin routes)."""
    return value.startswith(KEY_PREFIX)


def verify_key(plaintext: str, key_hash: str) -> bool:
    """Constant-time comparison of a presented key with a stored hash."""
    return hmac.compare_digest(hash_key(plaintext), key_hash)
