"""Checks on tenant and quota values from admins (HTTP bodies, CLI flags).

Each check returns the clean value or raises InvalidFieldError naming the offending field,
so the admin API can answer with a 400 whose ``param`` points at it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from datetime import UTC, datetime

from tenants.errors import InvalidFieldError

DEFAULT_TIERS: tuple[str, ...] = ("premium", "standard", "batch")

_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,63}")
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

# Quota count fields and the largest value their column holds.
QUOTA_COUNT_LIMITS: dict[str, int] = {
    "requests_per_minute": _INT32_MAX,
    "tokens_per_minute": _INT64_MAX,
    "burst_requests": _INT32_MAX,
    "burst_tokens": _INT64_MAX,
    "max_concurrent_requests": _INT32_MAX,
    "max_queued_requests": _INT32_MAX,
    "monthly_token_budget": _INT64_MAX,
    "monthly_spend_budget_usd_micros": _INT64_MAX,
    "file_storage_bytes": _INT64_MAX,
}
QUOTA_FIELDS: tuple[str, ...] = (*QUOTA_COUNT_LIMITS, "kv_cap_share")
# An API key's own limits (api_keys columns), each binding before its tenant's of that name.
KEY_LIMIT_FIELDS: tuple[str, ...] = (
    "requests_per_minute", "tokens_per_minute", "monthly_token_budget",
    "monthly_spend_budget_usd_micros",
)

QuotaValue = int | float | None


# An id as a client writes it: ASCII digits only (str.isdigit takes "²" and other digits
# int() refuses or reads otherwise), no more than the largest id holds.
_ROW_ID_PATTERN = re.compile(r"[0-9]{1,19}")
MAX_ROW_ID = _INT32_MAX  # tenants, API keys and audit entries have INTEGER ids


def is_row_id(value: str) -> bool:
    """Whether value is written as an id (ASCII digits), whatever its size."""
    return value.isascii() and value.isdigit()


def validate_row_id(value: str | int, param: str) -> int:
    """An id a caller names (a path segment, a query parameter, a CLI argument), in
    1..MAX_ROW_ID: anything else is an InvalidFieldError naming param (a 400), never a
    database overflow."""
    if isinstance(value, str):
        if not _ROW_ID_PATTERN.fullmatch(value):
            raise InvalidFieldError(f"{param} must be a positive integer", param)
        value = int(value)
    if not 1 <= value <= MAX_ROW_ID:
        raise InvalidFieldError(f"{param} must be between 1 and {MAX_ROW_ID}", param)
    return value


def validate_name(value: object, param: str = "name") -> str:
    if not isinstance(value, str) or not _NAME_PATTERN.fullmatch(value):
        raise InvalidFieldError(
            "name must be 1-64 characters of a-z, 0-9, '_' or '-', starting with a letter",
            param,
        )
    return value


def validate_tier(value: object, known_tiers: Collection[str], param: str = "tier") -> str:
    if not isinstance(value, str) or value not in known_tiers:
        raise InvalidFieldError(f"tier must be one of: {', '.join(sorted(known_tiers))}", param)
    return value


def validate_weight(value: object, param: str = "weight") -> float:
    number = _as_number(value, param)
    if not number > 0:
        raise InvalidFieldError("weight must be a number greater than 0", param)
    return number


# A served model's name as tenants' allowed lists hold it (the gateway's own rule for the names
# it serves): no whitespace, no ':' (which separates a base model from an adapter's name).
_MODEL_NAME_PATTERN = re.compile(r"[^\s:]{1,128}")
MAX_ALLOWED_MODELS = 64


def validate_model_name(value: object, param: str) -> str:
    if not isinstance(value, str) or not _MODEL_NAME_PATTERN.fullmatch(value):
        raise InvalidFieldError(
            "a model name is 1-128 characters without whitespace or ':'", param
        )
    return value


def validate_allowed_models(value: object, param: str = "allowed_models") -> list[str] | None:
    """The served models a tenant may use: a list of names (an empty list: none), or None
    for every model. Names are not checked against what a replica serves: replicas may serve
    different models, and a model may be added after its tenants."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidFieldError("allowed_models must be a list of model names or null", param)
    if len(value) > MAX_ALLOWED_MODELS:
        raise InvalidFieldError(f"allowed_models holds at most {MAX_ALLOWED_MODELS} names",
                                param)
    names = [validate_model_name(item, f"{param}[{i}]") for i, item in enumerate(value)]
    return list(dict.fromkeys(names))


def validate_expiry(value: object, now: datetime, param: str = "expires_at") -> datetime | None:
    """A key's expiry: None (never), or an ISO 8601 time with its time zone (a datetime
    with tzinfo), later than now."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidFieldError(
                "expires_at must be an ISO 8601 time, e.g. 2027-01-31T00:00:00Z", param
            ) from None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidFieldError("expires_at must be a time with its time zone (Z, +00:00...)",
                                param)
    if value <= now:
        raise InvalidFieldError("expires_at must be in the future", param)
    return value.astimezone(UTC)


def validate_cache_salt(value: object, param: str = "cache_salt") -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= 64:
        raise InvalidFieldError("cache_salt must be a string of 1-64 characters", param)
    return value


def validate_quota(values: Mapping[str, object], param: str = "quota") -> dict[str, QuotaValue]:
    """Clean quota fields (a subset is fine: the caller merges them); None means unlimited."""
    clean: dict[str, QuotaValue] = {}
    for field, value in values.items():
        field_param = f"{param}.{field}"
        if field not in QUOTA_FIELDS:
            raise InvalidFieldError(
                f"unknown quota field; expected one of: {', '.join(QUOTA_FIELDS)}", field_param
            )
        if value is None:
            clean[field] = None
        elif field == "kv_cap_share":
            share = _as_number(value, field_param)
            if not 0 < share <= 1:
                raise InvalidFieldError("kv_cap_share must be in (0, 1]", field_param)
            clean[field] = share
        else:
            clean[field] = _as_count(value, QUOTA_COUNT_LIMITS[field], field_param)
    return clean


def validate_key_limits(values: Mapping[str, object]) -> dict[str, int | None]:
    """Clean API key limit fields (a subset is fine: the caller sets only those); None means
    only the tenant's limit applies."""
    clean: dict[str, int | None] = {}
    for field, value in values.items():
        if field not in KEY_LIMIT_FIELDS:
            raise InvalidFieldError(
                f"unknown key limit; expected one of: {', '.join(KEY_LIMIT_FIELDS)}", field
            )
        clean[field] = None if value is None else _as_count(
            value, QUOTA_COUNT_LIMITS[field], field)
    return clean


def _as_number(value: object, param: str) -> float:
    # bool is an int subclass; true/false is never a meaningful weight or share.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidFieldError("must be a number", param)
    try:
        number = float(value)
    except OverflowError:  # an integer of 309 digits or more
        raise InvalidFieldError("must be a finite number", param) from None
    if not math.isfinite(number):
        raise InvalidFieldError("must be a finite number", param)
    return number


def _as_count(value: object, limit: int, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldError("must be an integer or null (unlimited)", param)
    if not 0 <= value <= limit:
        raise InvalidFieldError(f"must be between 0 and {limit}", param)
    return value
