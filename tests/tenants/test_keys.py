"""Key format, hashing and verification (no database)."""

from __future__ import annotations

import hashlib
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from tenants.keys import (
    PREFIX_LENGTH,
    generate_key,
    hash_key,
    looks_like_key,
    lookup_prefix,
    verify_key,
)

KEY_PATTERN = re.compile(r"tg-[a-z0-9]{8}_[A-Za-z0-9_-]{43,}")


def test_generated_key_has_the_documented_shape() -> None:
    key = generate_key()
    assert KEY_PATTERN.fullmatch(key.plaintext)
    assert key.prefix == key.plaintext[:PREFIX_LENGTH]
    assert key.key_hash == hashlib.sha256(key.plaintext.encode()).hexdigest()
    assert looks_like_key(key.plaintext)


def test_generated_keys_are_distinct() -> None:
    keys = [generate_key() for _ in range(2000)]
    assert len({k.plaintext for k in keys}) == len(keys)
    assert len({k.prefix for k in keys}) == len(keys)


def test_verify_accepts_the_key_and_rejects_any_other() -> None:
    key = generate_key()
    assert verify_key(key.plaintext, key.key_hash)
    assert not verify_key(key.plaintext + "x", key.key_hash)
    assert not verify_key(key.plaintext[:-1], key.key_hash)
    assert not verify_key(generate_key().plaintext, key.key_hash)


def test_lookup_prefix_of_generated_key() -> None:
    key = generate_key()
    assert lookup_prefix(key.plaintext) == key.prefix


def test_lookup_prefix_rejects_malformed_keys() -> None:
    for value in [
        "",
        "tg-",
        "tg-abcdefgh",
        "tg-abcdefgh_",
        "tg-ABCDEFGH_secret",
        "tg-abcdefgh-secret",
        "sk-abcdefgh_secret",
        "tg-abc_defgh_secret",
    ]:
        assert lookup_prefix(value) is None, value


@settings(deadline=None)  # a stall of the loaded CI machine is not a failure
@given(st.text(max_size=80))
def test_lookup_prefix_never_fails_on_arbitrary_text(value: str) -> None:
    prefix = lookup_prefix(value)
    assert prefix is None or (value.startswith(prefix) and len(prefix) == PREFIX_LENGTH)


def test_hash_is_hex_sha256() -> None:
    assert hash_key("tg-abc") == hashlib.sha256(b"tg-abc").hexdigest()
