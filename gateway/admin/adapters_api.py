"""LoRA adapters under /admin/v1/adapters: register, list, read, share or pin, unregister.

Registering takes either a JSON body naming a directory on the server
(``{"name", "owner", "shared_with", "path"}``) or the adapter's files as an archive in the
body (zip or tar, any other content type than JSON) with ``name``, ``owner`` and
``shared_with`` (comma-separated) as query parameters. ``base_model`` names the served model
the adapter is for (needed where the replica serves several). The files are checked against
that model before anything is stored; a refusal is a 400 naming the problem. Unregistering
answers once the requests running on the adapter on this replica have ended (200,
``deleted: true``), or after the drain timeout with ``deleted: false`` (202): the adapter
takes no new request either way, and a later DELETE finishes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import tenants
from engine import AdapterError
from gateway.adapters import AdapterRegistry, PinLimitError, read_archive, read_directory
from gateway.admin.auth import AdminGuard
from gateway.admin.bodies import (
    admin_actor,
    json_object,
    list_response,
    reject_unknown,
    translate_tenants_error,
)
from gateway.admin.roles import ADMIN_API_PREFIX
from gateway.http.errors import BadRequestError, PayloadTooLargeError, ServiceUnavailableError
from gateway.http.json_body import declared_length

if TYPE_CHECKING:
    from gateway.server.served_model import ServedModel

__all__ = ["adapter_routes"]

T = TypeVar("T")

_JSON_FIELDS = ("name", "owner", "shared_with", "path", "base_model")
_UPDATE_FIELDS = ("shared_with", "pinned")
# An archive holds the files and its own framing: the body may exceed the files a little.
_ARCHIVE_OVERHEAD = 1 << 20


def adapter_routes(guard: AdminGuard, registry: AdapterRegistry,
                   served_models: Callable[[], Mapping[str, ServedModel | None]],
                   unregister_timeout_s: float) -> list[Route]:
    """Routes to mount under /admin/v1. served_models: the replica's models by name (None
    until loaded)."""
    api = _AdaptersApi(registry, served_models, unregister_timeout_s)
    mounted_at = ADMIN_API_PREFIX
    return [
        guard.route("/adapters", api.list_adapters, "GET", mounted_at=mounted_at),
        guard.route("/adapters", api.register, "POST", mounted_at=mounted_at),
        guard.route("/adapters/{name}", api.get_adapter, "GET", mounted_at=mounted_at),
        guard.route("/adapters/{name}", api.update, "PATCH", mounted_at=mounted_at),
        guard.route("/adapters/{name}", api.unregister, "DELETE", mounted_at=mounted_at),
    ]


class _AdaptersApi:
    def __init__(self, registry: AdapterRegistry,
                 served_models: Callable[[], Mapping[str, ServedModel | None]],
                 unregister_timeout_s: float) -> None:
        self._registry = registry
        self._served_models = served_models
        self._unregister_timeout_s = unregister_timeout_s

    async def list_adapters(self, request: Request) -> Response:
        owner = request.query_params.get("owner")
        return list_response(await _tenants_call(self._registry.list_all(owner)))

    async def get_adapter(self, request: Request) -> Response:
        return JSONResponse(await _tenants_call(
            self._registry.get(request.path_params["name"])))

    async def register(self, request: Request) -> Response:
        max_bytes = self._registry.max_bytes
        if request.headers.get("content-type", "").startswith("application/json"):
            body = await json_object(request)
            reject_unknown(body, _JSON_FIELDS)
            served = self._base_model(body.get("base_model"))
            name, owner = _required(body, "name"), _required(body, "owner")
            shared = _tenant_list(body.get("shared_with", []))
            path = _required(body, "path")
            files = await _checked(run_in_threadpool(read_directory, Path(path), max_bytes))
        else:
            params = request.query_params
            served = self._base_model(params.get("base_model"))
            name, owner = _required(params, "name"), _required(params, "owner")
            raw_shared = params.get("shared_with", "")
            shared = [ref for ref in raw_shared.split(",") if ref]
            data = await _read_bounded(request, max_bytes + _ARCHIVE_OVERHEAD)
            files = await _checked(run_in_threadpool(read_archive, data, max_bytes))
        snapshot = await _checked(_tenants_call(self._registry.register(
            name=name, owner=owner, shared_with=shared, files=files, served_name=served.name,
            model_config=served.model_config, actor=admin_actor(request))))
        return JSONResponse(snapshot, status_code=201)

    def _base_model(self, name: object) -> ServedModel:
        """The loaded served model an adapter is registered for: the one named, or the only
        one served."""
        models = self._served_models()
        if name is None:
            if len(models) != 1:
                raise BadRequestError(
                    f"this server serves several models: name the adapter's base_model (one "
                    f"of {', '.join(sorted(models))})", param="base_model")
            name = next(iter(models))
        if not isinstance(name, str) or name not in models:
            raise BadRequestError(
                f"base_model must be a model this server serves: one of "
                f"{', '.join(sorted(models))}", param="base_model")
        served = models[name]
        if served is None:
            raise ServiceUnavailableError(f"the model {name!r} is not loaded: adapters are "
                                          "checked against it", code="model_loading")
        return served

    async def update(self, request: Request) -> Response:
        """PATCH: `shared_with` (the whole list) and/or `pinned`."""
        body = await json_object(request)
        reject_unknown(body, _UPDATE_FIELDS)
        shared = _tenant_list(body["shared_with"]) if "shared_with" in body else None
        pinned = body.get("pinned")
        if pinned is not None and not isinstance(pinned, bool):
            raise BadRequestError("pinned must be true or false", param="pinned")
        try:
            snapshot = await _tenants_call(self._registry.update(
                request.path_params["name"], admin_actor(request), shared_with=shared,
                pinned=pinned))
        except PinLimitError as exc:
            raise BadRequestError(str(exc), param="pinned", code="too_many_pinned") from None
        return JSONResponse(snapshot)

    async def unregister(self, request: Request) -> Response:
        result = await _tenants_call(self._registry.unregister(
            request.path_params["name"], admin_actor(request), self._unregister_timeout_s))
        return JSONResponse(result, status_code=200 if result["deleted"] else 202)


async def _tenants_call(call: Awaitable[T]) -> T:
    try:
        return await call
    except tenants.TenantsError as exc:
        raise translate_tenants_error(exc) from exc


async def _checked(call: Awaitable[T]) -> T:
    """An adapter refused: 400 naming the problem (nothing was stored)."""
    try:
        return await call
    except AdapterError as exc:
        raise BadRequestError(f"adapter refused: {exc}", param="adapter",
                              code="invalid_adapter") from None


def _required(source: Any, field: str) -> str:
    value = source.get(field)
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"missing required field {field!r}", param=field)
    return value


def _tenant_list(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str | int) for v in value):
        raise BadRequestError("shared_with must be a list of tenant ids or names",
                              param="shared_with")
    return [str(v) for v in value]


async def _read_bounded(request: Request, max_bytes: int) -> bytes:
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise PayloadTooLargeError(f"the archive is larger than {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLargeError(f"the archive is larger than {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise BadRequestError("the upload ended early") from None
    if not size:
        raise BadRequestError("the body holds no archive (or send JSON with a server path)",
                              param="adapter")
    return b"".join(chunks)
