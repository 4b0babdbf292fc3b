"""The adapter registry as a replica sees it, on SQLite and PostgreSQL: visibility per tenant
and per base model, pinning within the engines' bound, unregistering that waits for the
requests running on an adapter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

import tenants
from engine import ModelConfig
from gateway.adapters import AdapterRegistry, AdapterStore, PinLimitError, read_directory
from tests.engine.models.helpers import make_checkpoint
from tests.engine.models.lora_adapters import make_adapter

BASE = "tiny"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    base = tmp_path_factory.mktemp("base")
    make_checkpoint(base, "llama", seed=2)
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapter") / "a", 8, seed=1)
    config = ModelConfig.from_dict(json.loads((base / "config.json").read_text()))
    return Path(adapter.lora.path), config


def _registry(session_factory: sessionmaker[Session], root: Path) -> AdapterRegistry:
    return AdapterRegistry(session_factory, AdapterStore(root), max_rank=64, max_bytes=1 << 26,
                           max_pinned=1, cache_ttl_s=0.05)


def test_visibility_and_unregistering_waits_for_running_requests(
    session_factory: sessionmaker[Session], adapter_dir: tuple[Path, ModelConfig], tmp_path: Path
) -> None:
    path, config = adapter_dir
    with session_factory.begin() as session:
        owner = tenants.create_tenant(session, name="owner", tier="standard", actor="test").id
        friend = tenants.create_tenant(session, name="friend", tier="standard", actor="test").id
        stranger = tenants.create_tenant(session, name="stranger", tier="standard",
                                         actor="test").id
    registry = _registry(session_factory, tmp_path / "store")

    async def scenario() -> None:
        files = read_directory(path, 1 << 26)
        await registry.register(name="a", owner="owner", shared_with=["friend"], files=files,
                                served_name=BASE, model_config=config, actor="test")
        target = await registry.resolve("a", owner, (BASE,))
        assert target is not None and target.adapter == "a" and target.lora is not None
        assert Path(target.lora.path).is_dir()
        assert await registry.resolve(f"{BASE}:a", friend, (BASE,)) == target
        assert await registry.resolve("a", stranger, (BASE,)) is None
        assert await registry.resolve("a", owner, ("another-base",)) is None
        # Next to another base model: found by name or under its own base, never another's.
        both = ("another-base", BASE)
        assert await registry.resolve("a", owner, both) == target and target.base == BASE
        assert await registry.resolve("another-base:a", owner, both) is None
        assert await registry.resolve(f"{BASE}:a", owner, both) == target
        assert [c["id"] for c in await registry.visible(friend, (BASE,))] == ["a"]
        assert await registry.visible(stranger, (BASE,)) == []

        # Pinned: the engine is told with each request; one of a base model at most here.
        assert target.lora is not None and not target.lora.pinned
        assert (await registry.update("a", "test", pinned=True))["pinned"] is True
        await asyncio.sleep(0.06)  # the cache's lifetime
        pinned = await registry.resolve("a", owner, (BASE,))
        assert pinned is not None and pinned.lora is not None and pinned.lora.pinned
        await registry.register(name="b", owner="owner", shared_with=[], files=files,
                                served_name=BASE, model_config=config, actor="test")
        with pytest.raises(PinLimitError, match="1 adapters of tiny are pinned already"):
            await registry.update("b", "test", pinned=True, shared_with=["friend"])
        assert (await registry.get("b"))["shared_with"] == []  # nothing changed
        assert (await registry.update("a", "test", pinned=False))["pinned"] is False
        assert (await registry.update("b", "test", pinned=True))["pinned"] is True
        assert (await registry.unregister("b", "test", timeout_s=1.0))["deleted"] is True
        assert registry.store.has(target.lora.name)  # "a" has the same files

        registry.started(target)
        pending = await registry.unregister("a", "test", timeout_s=0.2)
        assert pending["deleted"] is False and pending["running_here"] == 1
        assert await registry.resolve("a", owner, (BASE,)) is None  # no new request meanwhile
        registry.ended(target)
        done = await registry.unregister("a", "test", timeout_s=5.0)
        assert done["deleted"] is True
        assert not registry.store.path(target.lora.name).exists()  # nor on this disk
        assert await registry.list_all() == []

    asyncio.run(scenario())
    with session_factory() as session:
        actions = [e.action for e in tenants.list_audit_entries(session)
                   if e.target_type == "lora_adapter"]
        assert actions.count("lora_adapter.unregister") == 2
        assert actions.count("lora_adapter.pin") == 2
        assert actions.count("lora_adapter.unpin") == 1
        assert "lora_adapter.delete" in actions
        with pytest.raises(tenants.AdapterNotFoundError):
            tenants.adapter_files(session, target_hash(path))


def target_hash(path: Path) -> str:
    from gateway.adapters import content_hash

    return content_hash(read_directory(path, 1 << 26))
