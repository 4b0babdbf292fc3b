"""Which admin role each /admin route needs: one table, checked when routes are built.

Every admin route is built through AdminGuard.route (or AdminGuard.requiring), which looks
its method and full path pattern up here and refuses to build one that is missing, so a new
route cannot go unguarded by accident; tests/gateway/admin/test_admin_roles.py also compares
the app's routes with this table both ways.

Roles: read-only may read everything (every GET but the billing export); billing adds the
billing exports and any billing write; operator adds changes to tenants, quotas, keys and
adapters; owner may do everything. billing and operator do not include each other.
"""

from __future__ import annotations

from typing import Final

from tenants import AdminRole

__all__ = [
    "ADMIN_API_PREFIX",
    "NO_CREDENTIAL",
    "ROUTE_ROLES",
    "RouteKey",
    "UnmappedAdminRouteError",
    "grants",
    "required_role",
]

# Where the admin API's Mount sits; the table names full paths.
ADMIN_API_PREFIX: Final = "/admin/v1"
# (HTTP method, full path pattern as Starlette writes it), e.g. ("GET", "/admin/v1/tenants").
RouteKey = tuple[str, str]
# The console's page and assets hold no data (everything comes from /admin/v1): a browser
# loads them before it has any credential to send.
NO_CREDENTIAL: Final = None

_READ, _BILLING = AdminRole.READ_ONLY, AdminRole.BILLING
_OPERATOR = AdminRole.OPERATOR

ROUTE_ROLES: Final[dict[RouteKey, AdminRole | None]] = {
    # who is asking (the console hides what the role may not use)
    ("GET", "/admin/v1/whoami"): _READ,
    # tenants and their quotas
    ("GET", "/admin/v1/tenants"): _READ,
    ("POST", "/admin/v1/tenants"): _OPERATOR,
    ("GET", "/admin/v1/tenants/{tenant}"): _READ,
    ("PATCH", "/admin/v1/tenants/{tenant}"): _OPERATOR,
    ("POST", "/admin/v1/tenants/{tenant}/disable"): _OPERATOR,
    ("POST", "/admin/v1/tenants/{tenant}/enable"): _OPERATOR,
    # a tenant's batches and files (the Batches and Files APIs)
    ("GET", "/admin/v1/tenants/{tenant}/batches"): _READ,
    ("GET", "/admin/v1/tenants/{tenant}/files"): _READ,
    # tenant API keys
    ("GET", "/admin/v1/tenants/{tenant}/keys"): _READ,
    ("POST", "/admin/v1/tenants/{tenant}/keys"): _OPERATOR,
    ("GET", "/admin/v1/keys/{key_id:int}"): _READ,
    ("PATCH", "/admin/v1/keys/{key_id:int}"): _OPERATOR,
    ("DELETE", "/admin/v1/keys/{key_id:int}"): _OPERATOR,
    ("POST", "/admin/v1/keys/{key_id:int}/revoke"): _OPERATOR,
    ("POST", "/admin/v1/keys/{key_id:int}/rotate"): _OPERATOR,
    # LoRA adapters
    ("GET", "/admin/v1/adapters"): _READ,
    ("POST", "/admin/v1/adapters"): _OPERATOR,
    ("GET", "/admin/v1/adapters/{name}"): _READ,
    ("PATCH", "/admin/v1/adapters/{name}"): _OPERATOR,
    ("DELETE", "/admin/v1/adapters/{name}"): _OPERATOR,
    # the audit log and the replica's read-outs
    ("GET", "/admin/v1/audit"): _READ,
    ("GET", "/admin/v1/live"): _READ,
    ("GET", "/admin/v1/alerts"): _READ,
    ("GET", "/admin/v1/metrics"): _READ,
    # billing: the daily usage every reader sees; the invoiceable export is billing's
    ("GET", "/admin/v1/billing/usage"): _READ,
    ("GET", "/admin/v1/billing/export"): _BILLING,
    # the console
    ("GET", "/admin"): NO_CREDENTIAL,
    ("GET", "/admin/"): NO_CREDENTIAL,
    ("GET", "/admin/assets/{file}"): NO_CREDENTIAL,
}


class UnmappedAdminRouteError(LookupError):
    """An admin route was built that ROUTE_ROLES does not name: add it to the table."""


def required_role(method: str, path: str) -> AdminRole | None:
    """The least role the route needs (NO_CREDENTIAL: none); raises for a route not in the
    table."""
    try:
        return ROUTE_ROLES[(method, path)]
    except KeyError:
        raise UnmappedAdminRouteError(
            f"{method} {path} has no entry in gateway.admin.roles.ROUTE_ROLES") from None


def grants(held: AdminRole, needed: AdminRole) -> bool:
    """Whether a credential of role held may use a route that needs role needed."""
    return held is AdminRole.OWNER or held is needed or needed is AdminRole.READ_ONLY
