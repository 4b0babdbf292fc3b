"""The admin HTTP API under /admin/v1: tenants and their quotas, API keys, the audit log,
and whoami (the credential asking).

Authenticated by an admin credential or the deployment's TIERGATE_ADMIN_TOKEN, each route
needing the role gateway.admin.roles names (gateway.admin.auth). Tenant keys never open
these routes: one presented here gets 403. With neither a token nor a credential every
/admin/v1 route answers 404 with code ``admin_api_disabled``.

Every write goes through tenants.repository, which records an audit entry (before/after)
in the same transaction; changes that affect authentication are pushed to this process's
key cache at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount

import tenants
from gateway.access.auth import TenantKeyResolver
from gateway.adapters import AdapterRegistry
from gateway.admin.adapters_api import adapter_routes
from gateway.admin.auth import AdminGuard
from gateway.admin.bodies import (
    admin_actor,
    admin_principal,
    json_object,
    list_response,
    reject_unknown,
    translate_tenants_error,
)
from gateway.admin.roles import ADMIN_API_PREFIX, grants
from gateway.batches.api import batch_object
from gateway.files.api import file_object
from gateway.http.errors import (
    BadRequestError,
)
from tenants import DEFAULT_TIERS, AdminRole, TenantStatus

if TYPE_CHECKING:
    from gateway.server.served_model import ServedModel

logger = logging.getLogger(__name__)

DEFAULT_AUDIT_PAGE = 100
MAX_AUDIT_PAGE = 1000
_CREATE_TENANT_FIELDS = ("name", "tier", "weight", "cache_salt", "allowed_models", "quota")

T = TypeVar("T")

# Batches and files a tenant's page lists at most (the latest).
MAX_LISTED = 100


def admin_routes(
    *,
    session_factory: sessionmaker[Session],
    admin_token: str | None,
    key_resolver: TenantKeyResolver | None = None,
    known_tiers: Collection[str] = DEFAULT_TIERS,
    adapters: AdapterRegistry | None = None,
    served_models: Callable[[], Mapping[str, ServedModel | None]] = dict,
    unregister_timeout_s: float = 30.0,
    guard: AdminGuard | None = None,
) -> list[BaseRoute]:
    """Routes to add to the app, checked by guard (default: admin_token, if set, and the
    admin credentials in session_factory's database).

    key_resolver, when given, is the resolver the app authenticates tenants with: revoking a
    key or changing a tenant here invalidates its cache entries immediately. adapters, when
    given, adds the LoRA adapter routes (gateway.admin.adapters_api), which check an adapter
    against the base model it names in served_models() and wait up to unregister_timeout_s
    for its requests to end.
    """
    if guard is None:
        guard = AdminGuard.for_deployment(admin_token, session_factory)
    api = _AdminApi(session_factory, key_resolver, known_tiers)
    routes = [
        ("/whoami", whoami, "GET"),
        ("/tenants", api.list_tenants, "GET"),
        ("/tenants", api.create_tenant, "POST"),
        ("/tenants/{tenant}", api.get_tenant, "GET"),
        ("/tenants/{tenant}", api.update_tenant, "PATCH"),
        ("/tenants/{tenant}/disable", api.disable_tenant, "POST"),
        ("/tenants/{tenant}/enable", api.enable_tenant, "POST"),
        ("/tenants/{tenant}/batches", api.list_batches, "GET"),
        ("/tenants/{tenant}/files", api.list_files, "GET"),
        ("/tenants/{tenant}/keys", api.list_keys, "GET"),
        ("/tenants/{tenant}/keys", api.create_key, "POST"),
        ("/keys/{key_id:int}", api.get_key, "GET"),
        ("/keys/{key_id:int}", api.revoke_key, "DELETE"),
        ("/keys/{key_id:int}", api.update_key, "PATCH"),
        ("/keys/{key_id:int}/revoke", api.revoke_key, "POST"),
        ("/keys/{key_id:int}/rotate", api.rotate_key, "POST"),
        ("/audit", api.list_audit, "GET"),
    ]
    return [
        Mount(
            ADMIN_API_PREFIX,
            routes=[
                *(guard.route(path, handler, method, mounted_at=ADMIN_API_PREFIX)
                  for path, handler, method in routes),
                *([] if adapters is None else adapter_routes(
                    guard, adapters, served_models, unregister_timeout_s)),
            ],
        )
    ]


async def whoami(request: Request) -> Response:
    """The credential asking: its id (null for TIERGATE_ADMIN_TOKEN), name and role, and
    which roles' routes it may use (the console hides the controls it may not)."""
    principal = admin_principal(request)
    return JSONResponse({
        "object": "admin_credential",
        "id": principal.credential_id,
        "name": principal.name,
        "role": principal.role.value,
        "grants": {role.value: grants(principal.role, role) for role in AdminRole},
    })


class _AdminApi:
    def __init__(
        self,
        session_factory: sessionmaker[Session],
        key_resolver: TenantKeyResolver | None,
        known_tiers: Collection[str],
    ) -> None:
        self._session_factory = session_factory
        self._key_resolver = key_resolver
        self._known_tiers = tuple(known_tiers)

    async def _in_session(self, work: Callable[[Session], T]) -> T:
        """Run work in one transaction off the event loop, translating tenants errors."""

        def run() -> T:
            try:
                with self._session_factory.begin() as session:
                    return work(session)
            except tenants.TenantsError as exc:
                raise translate_tenants_error(exc) from exc

        return await run_in_threadpool(run)

    def _forget(self, *, tenant_id: int | None = None, api_key_id: int | None = None) -> None:
        if self._key_resolver is not None:
            self._key_resolver.invalidate(tenant_id=tenant_id, api_key_id=api_key_id)

    # --- tenants ---------------------------------------------------------------------------

    async def list_tenants(self, request: Request) -> Response:
        status = _status_param(request.query_params.get("status"))
        data = await self._in_session(
            lambda s: [tenants.tenant_snapshot(t) for t in tenants.list_tenants(s, status=status)]
        )
        return list_response(data)

    async def create_tenant(self, request: Request) -> Response:
        body = await json_object(request)
        reject_unknown(body, _CREATE_TENANT_FIELDS)
        if "name" not in body:
            raise BadRequestError("missing required field 'name'", param="name")
        quota = body.get("quota")
        if quota is None:
            quota = {}
        elif not isinstance(quota, Mapping):
            raise BadRequestError("quota must be an object", param="quota")
        actor = admin_actor(request)

        def work(session: Session) -> dict[str, Any]:
            tenant = tenants.create_tenant(
                session,
                name=body["name"],
                tier=body.get("tier", "standard"),
                weight=body.get("weight", 1.0),
                quota=quota,
                cache_salt=body.get("cache_salt"),
                allowed_models=body.get("allowed_models"),
                actor=actor,
                known_tiers=self._known_tiers,
            )
            return tenants.tenant_snapshot(tenant)

        return JSONResponse(await self._in_session(work), status_code=201)

    async def get_tenant(self, request: Request) -> Response:
        ref = request.path_params["tenant"]
        return JSONResponse(
            await self._in_session(lambda s: tenants.tenant_snapshot(tenants.find_tenant(s, ref)))
        )

    async def update_tenant(self, request: Request) -> Response:
        ref, actor = request.path_params["tenant"], admin_actor(request)
        body = await json_object(request)

        def work(session: Session) -> dict[str, Any]:
            tenant = tenants.find_tenant(session, ref)
            tenants.update_tenant(session, tenant, body, actor=actor, known_tiers=self._known_tiers)
            return tenants.tenant_snapshot(tenant)

        snapshot = await self._in_session(work)
        self._forget(tenant_id=snapshot["id"])
        return JSONResponse(snapshot)

    async def disable_tenant(self, request: Request) -> Response:
        return await self._set_status(request, TenantStatus.DISABLED)

    async def enable_tenant(self, request: Request) -> Response:
        return await self._set_status(request, TenantStatus.ACTIVE)

    async def _set_status(self, request: Request, status: TenantStatus) -> Response:
        ref, actor = request.path_params["tenant"], admin_actor(request)

        def work(session: Session) -> dict[str, Any]:
            tenant = tenants.find_tenant(session, ref)
            tenants.set_tenant_status(session, tenant, status, actor=actor)
            return tenants.tenant_snapshot(tenant)

        snapshot = await self._in_session(work)
        self._forget(tenant_id=snapshot["id"])
        return JSONResponse(snapshot)

    # --- keys ------------------------------------------------------------------------------

    async def list_batches(self, request: Request) -> Response:
        """The tenant's latest batches (the Batches API), newest first, as the API shows
        them."""
        ref = request.path_params["tenant"]

        def work(session: Session) -> list[dict[str, Any]]:
            tenant = tenants.find_tenant(session, ref)
            return [batch_object(b, tenants.line_counts(session, b.id))
                    for b in tenants.list_batches(session, tenant.id, after=None,
                                                  limit=MAX_LISTED)]

        return list_response(await self._in_session(work))

    async def list_files(self, request: Request) -> Response:
        """The tenant's latest uploaded files and batch result files, newest first."""
        ref = request.path_params["tenant"]

        def work(session: Session) -> list[dict[str, Any]]:
            tenant = tenants.find_tenant(session, ref)
            return [file_object(f) for f in tenants.list_files(
                session, tenant.id, purpose=None, after=None, limit=MAX_LISTED,
                newest_first=True)]

        return list_response(await self._in_session(work))

    async def list_keys(self, request: Request) -> Response:
        ref = request.path_params["tenant"]

        def work(session: Session) -> list[dict[str, Any]]:
            tenant = tenants.find_tenant(session, ref)
            return [
                tenants.api_key_snapshot(k)
                for k in tenants.list_api_keys(session, tenant_id=tenant.id)
            ]

        return list_response(await self._in_session(work))

    async def create_key(self, request: Request) -> Response:
        ref, actor = request.path_params["tenant"], admin_actor(request)
        body = await json_object(request, allow_empty=True)
        reject_unknown(body, ("name", "expires_at", "allowed_models", *tenants.KEY_LIMIT_FIELDS))

        def work(session: Session) -> dict[str, Any]:
            tenant = tenants.find_tenant(session, ref)
            created = tenants.create_api_key(
                session, tenant, name=body.get("name", "default"), actor=actor,
                expires_at=body.get("expires_at"), allowed_models=body.get("allowed_models"),
                limits=_key_limits(body),
            )
            # The only time the plaintext leaves the server.
            return {**tenants.api_key_snapshot(created.api_key), "key": created.plaintext}

        return JSONResponse(await self._in_session(work), status_code=201)

    async def get_key(self, request: Request) -> Response:
        key_id: int = request.path_params["key_id"]
        return JSONResponse(
            await self._in_session(
                lambda s: tenants.api_key_snapshot(tenants.get_api_key(s, key_id))
            )
        )

    async def update_key(self, request: Request) -> Response:
        """{"allowed_models": [...] | null}: the models the key may use, within its tenant's
        (null: the tenant's); and/or the key's own limits (requests_per_minute,
        tokens_per_minute, monthly_token_budget, monthly_spend_budget_usd_micros: a
        non-negative integer, or null: only the tenant's applies)."""
        key_id: int = request.path_params["key_id"]
        actor = admin_actor(request)
        body = await json_object(request)
        reject_unknown(body, ("allowed_models", *tenants.KEY_LIMIT_FIELDS))
        limits = _key_limits(body)
        if "allowed_models" not in body and not limits:
            raise BadRequestError(
                "nothing to change: send allowed_models or a key limit", param="body")

        def work(session: Session) -> dict[str, Any]:
            api_key = tenants.get_api_key(session, key_id)
            if "allowed_models" in body:
                tenants.set_api_key_models(
                    session, api_key, allowed_models=body["allowed_models"], actor=actor)
            if limits:
                tenants.set_api_key_limits(session, api_key, limits=limits, actor=actor)
            return tenants.api_key_snapshot(api_key)

        snapshot = await self._in_session(work)
        self._forget(api_key_id=key_id)
        return JSONResponse(snapshot)

    async def rotate_key(self, request: Request) -> Response:
        """A new secret for the key (its id kept); the old one works for grace_seconds
        (default 0: stops now). The new secret is shown once."""
        key_id: int = request.path_params["key_id"]
        actor = admin_actor(request)
        body = await json_object(request, allow_empty=True)
        reject_unknown(body, ("grace_seconds",))

        def work(session: Session) -> dict[str, Any]:
            rotated = tenants.rotate_api_key(
                session, tenants.get_api_key(session, key_id),
                grace_s=body.get("grace_seconds", 0), actor=actor)
            return {**tenants.api_key_snapshot(rotated.api_key), "key": rotated.plaintext}

        snapshot = await self._in_session(work)
        self._forget(api_key_id=key_id)
        return JSONResponse(snapshot)

    async def revoke_key(self, request: Request) -> Response:
        key_id: int = request.path_params["key_id"]
        actor = admin_actor(request)

        def work(session: Session) -> dict[str, Any]:
            api_key = tenants.revoke_api_key(
                session, tenants.get_api_key(session, key_id), actor=actor
            )
            return tenants.api_key_snapshot(api_key)

        snapshot = await self._in_session(work)
        self._forget(api_key_id=key_id)
        return JSONResponse(snapshot)

    # --- audit -----------------------------------------------------------------------------

    async def list_audit(self, request: Request) -> Response:
        query = request.query_params
        limit = _int_param(query.get("limit"), "limit", low=1, high=MAX_AUDIT_PAGE)
        before = query.get("before")
        before_id = None if before is None else _row_id(before, "before")
        target_type, target_id = query.get("target_type"), query.get("target_id")
        data = await self._in_session(
            lambda s: [
                tenants.audit_entry_snapshot(e)
                for e in tenants.list_audit_entries(
                    s,
                    limit=DEFAULT_AUDIT_PAGE if limit is None else limit,
                    before_id=before_id,
                    target_type=target_type,
                    target_id=target_id,
                )
            ]
        )
        return list_response(data)


def _key_limits(body: Mapping[str, Any]) -> dict[str, Any]:
    """The key limit fields a body sends (validated by tenants)."""
    return {field: body[field] for field in tenants.KEY_LIMIT_FIELDS if field in body}


def _status_param(value: str | None) -> TenantStatus | None:
    if value is None:
        return None
    try:
        return TenantStatus(value)
    except ValueError:
        choices = ", ".join(s.value for s in TenantStatus)
        raise BadRequestError(f"status must be one of: {choices}", param="status") from None


def _int_param(value: str | None, param: str, *, low: int, high: int) -> int | None:
    """A query parameter as an int in [low, high] (ASCII digits), or None when absent."""
    if value is None:
        return None
    if not tenants.is_row_id(value) or len(value) > len(str(high)) or not (
            low <= int(value) <= high):
        raise BadRequestError(f"{param} must be an integer between {low} and {high}",
                              param=param)
    return int(value)


def _row_id(value: str, param: str) -> int:
    try:
        return tenants.validate_row_id(value, param)
    except tenants.InvalidFieldError as exc:
        raise BadRequestError(str(exc), param=exc.param) from None
