"""The adapter registry as one replica sees it: what a request's `model` names, for its
tenant; registering (checked against the served model first), sharing and unregistering.

The registry lives in the database (tenants.adapters), so every replica sees every adapter
and nothing is lost on a restart. A replica keeps what it read of an adapter for
`cache_ttl_s` (a request does not read the database each time); the changes this replica
makes drop its own copy at once, others' within that time. An adapter a tenant may not use
resolves exactly as a name nobody registered: the caller answers both with one 404.

Unregistering marks the adapter first (no new request may use it, here at once, elsewhere
within the cache's lifetime), waits until the requests running on it here have ended, then
deletes it. The engine has read an adapter into memory when its request starts, so a
replica's running requests never need the files again.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

import tenants
from engine import AdapterError, LoraRequest, ModelConfig, read_lora_adapter
from gateway.adapters.archive import CONFIG, WEIGHTS, AdapterFiles
from gateway.adapters.store import AdapterStore, content_hash

__all__ = ["AdapterRegistry", "ModelTarget"]

T = TypeVar("T")


@dataclass(frozen=True)
class ModelTarget:
    """What a request runs on."""

    name: str  # the model id its response reports: the served model's or the adapter's name
    base: str  # the served model whose engine runs it
    adapter: str | None = None  # the adapter's name (usage records, metrics); None: the base
    lora: LoraRequest | None = None  # what the engine is told


class PinLimitError(Exception):
    """Pinning one more adapter of a base model would pass what an engine keeps pinned."""


@dataclass(frozen=True)
class _Entry:
    name: str
    base_model: str
    owner_tenant_id: int
    shared_with: frozenset[int]
    content_hash: str
    created: int
    pinned: bool

    def visible_to(self, tenant_id: int, bases: Collection[str]) -> bool:
        return self.base_model in bases and (
            tenant_id == self.owner_tenant_id or tenant_id in self.shared_with)


def _entry(adapter: tenants.LoraAdapter) -> _Entry:
    return _Entry(adapter.name, adapter.base_model, adapter.owner_tenant_id,
                  frozenset(adapter.shared_with), adapter.content_hash,
                  int(adapter.created_at.timestamp()), adapter.pinned)


class AdapterRegistry:
    """Adapters for this replica's requests and admin routes."""

    def __init__(self, session_factory: sessionmaker[Session], store: AdapterStore, *,
                 max_rank: int, max_bytes: int, max_pinned: int = 0, cache_ttl_s: float = 2.0,
                 serves_adapters: bool = True) -> None:
        """serves_adapters: whether this replica's engine has adapter slots (False: requests
        never resolve to an adapter here; the admin routes still manage the registry).
        max_pinned: the most adapters of one base model that may be pinned (what an engine's
        host cache holds besides its slots' adapters)."""
        self._session_factory = session_factory
        self.serves_adapters = serves_adapters
        self.store = store
        self.max_rank = max_rank
        self.max_bytes = max_bytes
        self.max_pinned = max_pinned
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[_Entry | None, float]] = {}  # name -> (entry, expiry)
        self._running: dict[str, int] = {}  # adapter name -> requests running on it here
        self._idle: dict[str, asyncio.Event] = {}

    # -- requests ------------------------------------------------------------------------------

    async def resolve(self, model: str, tenant_id: int,
                      bases: Collection[str]) -> ModelTarget | None:
        """What `model` names for the tenant, among the served models bases (those it may
        use): one of them, an adapter of one it owns or was granted (by its name or
        "<served model>:<name>"), or None."""
        if model in bases:
            return ModelTarget(model, model)
        if not self.serves_adapters:
            return None
        base, colon, name = model.partition(":")
        if not colon:
            name = model
        elif base in bases:
            bases = (base,)
        else:
            return None
        entry = await self._lookup(name)
        if entry is None or not entry.visible_to(tenant_id, bases):
            return None
        if not self.store.has(entry.content_hash):
            await run_in_threadpool(self._materialize, entry.content_hash)
        lora = LoraRequest(name=entry.content_hash, path=str(self.store.path(entry.content_hash)),
                           pinned=entry.pinned)
        return ModelTarget(entry.name, entry.base_model, entry.name, lora)

    def started(self, target: ModelTarget) -> None:
        """A request on target runs (unregistering its adapter waits for it)."""
        if target.adapter is not None:
            self._running[target.adapter] = self._running.get(target.adapter, 0) + 1
            self._idle.setdefault(target.adapter, asyncio.Event()).clear()

    def ended(self, target: ModelTarget) -> None:
        name = target.adapter
        if name is not None:
            self._running[name] -= 1
            if not self._running[name]:
                del self._running[name]
                self._idle.pop(name, asyncio.Event()).set()

    def num_running(self, name: str) -> int:
        return self._running.get(name, 0)

    async def visible(self, tenant_id: int, bases: Collection[str]) -> list[dict[str, Any]]:
        """The model cards of the adapters of bases the tenant may use (/v1/models)."""
        if not self.serves_adapters:
            return []
        adapters = await self._in_session(
            lambda s: [_entry(a) for a in tenants.list_adapters(s, tenant_id=tenant_id)])
        return [_card(e) for e in adapters if e.visible_to(tenant_id, bases)]

    async def _lookup(self, name: str) -> _Entry | None:
        cached = self._cache.get(name)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]

        def read(session: Session) -> _Entry | None:
            try:
                return _entry(tenants.find_adapter(session, name))
            except tenants.AdapterNotFoundError:
                return None

        entry = await self._in_session(read)
        self._cache[name] = (entry, now + self.cache_ttl_s)
        return entry

    def _materialize(self, digest: str) -> None:
        with self._session_factory() as session:
            config_json, weights = tenants.adapter_files(session, digest)
        self.store.write(digest, AdapterFiles(config_json, weights))

    # -- admin ---------------------------------------------------------------------------------

    async def register(self, *, name: str, owner: str, shared_with: list[str],
                       files: AdapterFiles, served_name: str, model_config: ModelConfig,
                       actor: str) -> dict[str, Any]:
        """Check the files against the served model, then store them and the adapter's row
        (AdapterError or a tenants error on refusal: nothing is stored then)."""
        if name == served_name or ":" in name:
            raise AdapterError(f"an adapter may not be named {name!r}")
        if files.size > self.max_bytes:
            raise AdapterError(f"the adapter's files are over the limit of {self.max_bytes} "
                               "bytes")
        rank, targets = await run_in_threadpool(self._check, files, model_config)
        digest = content_hash(files)

        def work(session: Session) -> dict[str, Any]:
            owner_row = tenants.find_tenant(session, owner)
            granted = [tenants.find_tenant(session, ref) for ref in shared_with]
            adapter = tenants.register_adapter(
                session, name=name, base_model=served_name, owner=owner_row,
                shared_with=granted, content_hash=digest, config_json=files.config_json,
                weights=files.weights, rank=rank, targets=targets, actor=actor)
            return tenants.adapter_snapshot(adapter)

        snapshot = await self._in_session(work)
        self._cache.pop(name, None)
        await run_in_threadpool(self.store.write, digest, files)
        return snapshot

    def _check(self, files: AdapterFiles, model_config: ModelConfig) -> tuple[int, list[str]]:
        with tempfile.TemporaryDirectory(prefix="tiergate-adapter-") as scratch:
            directory = Path(scratch)
            (directory / CONFIG).write_bytes(files.config_json)
            (directory / WEIGHTS).write_bytes(files.weights)
            adapter = read_lora_adapter(directory, model_config, self.max_rank, self.max_bytes)
        return adapter.rank, list(adapter.targets)

    async def get(self, name: str) -> dict[str, Any]:
        snapshot = await self._in_session(
            lambda s: tenants.adapter_snapshot(tenants.find_adapter(s, name,
                                                                    include_deleting=True)))
        return {**snapshot, "running_here": self.num_running(name)}

    async def list_all(self, owner: str | None = None) -> list[dict[str, Any]]:
        def work(session: Session) -> list[dict[str, Any]]:
            tenant_id = None if owner is None else tenants.find_tenant(session, owner).id
            adapters = tenants.list_adapters(session, tenant_id=tenant_id)
            return [tenants.adapter_snapshot(a) for a in adapters]

        return await self._in_session(work)

    async def update(self, name: str, actor: str, *, shared_with: list[str] | None = None,
                     pinned: bool | None = None) -> dict[str, Any]:
        """Replace who it is shared with, and pin or unpin it: at most max_pinned adapters of
        one base model are pinned (PinLimitError past it: nothing changes)."""
        max_pinned = self.max_pinned
        def work(session: Session) -> dict[str, Any]:
            adapter = tenants.find_adapter(session, name)
            if shared_with is not None:
                granted = [tenants.find_tenant(session, ref) for ref in shared_with]
                tenants.share_adapter(session, adapter, granted, actor=actor)
            if pinned is not None:
                if pinned and not adapter.pinned and tenants.count_pinned(
                        session, adapter.base_model) >= max_pinned:
                    raise PinLimitError(
                        f"{max_pinned} adapters of {adapter.base_model} are pinned already, "
                        "as many as the engine's host cache keeps pinned (--max-cpu-loras "
                        "less --max-loras): unpin one first")
                tenants.pin_adapter(session, adapter, pinned, actor=actor)
            return tenants.adapter_snapshot(adapter)

        snapshot = await self._in_session(work)
        self._cache.pop(name, None)
        return snapshot

    async def unregister(self, name: str, actor: str, timeout_s: float) -> dict[str, Any]:
        """Stop new requests on the adapter, wait (up to timeout_s) for the ones running
        here, then delete it. Returns its last snapshot, with "deleted": whether it is gone
        (False: requests still run on it; it takes no new ones, and a later call ends it)."""
        snapshot = await self._in_session(lambda s: tenants.adapter_snapshot(
            tenants.begin_unregister(s, tenants.find_adapter(s, name, include_deleting=True),
                                     actor=actor)))
        self._cache[name] = (None, time.monotonic() + self.cache_ttl_s)
        deadline = time.monotonic() + timeout_s
        # Requests admitted by others' caches before the mark: let those caches expire.
        await asyncio.sleep(min(self.cache_ttl_s, timeout_s))
        idle = self._idle.get(name)
        if idle is not None:
            try:
                await asyncio.wait_for(idle.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return {**snapshot, "deleted": False, "running_here": self.num_running(name)}

        def remove(session: Session) -> bool:
            return tenants.remove_adapter(
                session, tenants.find_adapter(session, name, include_deleting=True),
                actor=actor)

        if await self._in_session(remove):  # no adapter has its files: nor does this disk
            await run_in_threadpool(self.store.remove, snapshot["content_hash"])
        return {**snapshot, "deleted": True, "running_here": 0}

    async def _in_session(self, work: Callable[[Session], T]) -> T:
        def run() -> T:
            with self._session_factory.begin() as session:
                return work(session)

        return await run_in_threadpool(run)


def _card(entry: _Entry) -> dict[str, Any]:
    return {"id": entry.name, "object": "model", "created": entry.created,
            "owned_by": "tenant", "parent": entry.base_model, "root": entry.base_model}
