"""The tenants package's exception tree; the gateway translates these to OpenAI error bodies.

TenantsError
├── InvalidFieldError      a value a caller supplied is not acceptable (names the field)
├── RowNotFoundError
│   ├── TenantNotFoundError
│   ├── ApiKeyNotFoundError
│   ├── AdapterNotFoundError
│   └── AdminCredentialNotFoundError
└── DuplicateError         the change would break a uniqueness rule (duplicate name)
"""

from __future__ import annotations


class TenantsError(Exception):
    """Base class of every error the tenants package raises on purpose."""


class InvalidFieldError(TenantsError):
    """A field of a create or update request is missing, of the wrong type or out of range."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RowNotFoundError(TenantsError):
    """The referenced row does not exist."""


class TenantNotFoundError(RowNotFoundError):
    """No tenant with this id or name."""


class ApiKeyNotFoundError(RowNotFoundError):
    """No API key with this id."""


class AdapterNotFoundError(RowNotFoundError):
    """No live LoRA adapter with this name."""


class DuplicateError(TenantsError):
    """The change would duplicate what must be unique, e.g. a tenant name already taken."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AdminCredentialNotFoundError(RowNotFoundError):
    """No admin credential with this id."""
