"""OpenAI's `metadata` of an object a client creates (a response, a batch): up to 16 string
pairs, keys up to 64 characters, values up to 512."""

from __future__ import annotations

from gateway.http.errors import BadRequestError

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def parse_metadata(value: object) -> dict[str, str]:
    """OpenAI's metadata: up to 16 string pairs, keys up to 64 characters, values 512."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequestError("metadata must be an object", param="metadata")
    if len(value) > MAX_METADATA_KEYS:
        raise BadRequestError(f"metadata holds at most {MAX_METADATA_KEYS} keys",
                              param="metadata")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise BadRequestError(f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} "
                                  "characters", param="metadata")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise BadRequestError(f"metadata values must be strings of at most "
                                  f"{MAX_METADATA_VALUE_CHARS} characters",
                                  param=f"metadata.{key}")
    return dict(value)
