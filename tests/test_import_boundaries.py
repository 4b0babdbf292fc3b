"""The import boundaries between the project's packages (docs/ARCHITECTURE.md, "Packages"),
checked on the source with `ast`.

A package's modules are private to it: another package imports only the names of its
`__all__`, from the package itself (`from engine import SchedulerStats`, `tenants.hash_key`
after `import tenants`), never a module past it (`from engine.scheduler import Scheduler`,
`import engine.scheduler`). And a package imports only the packages the design lets it.
tests/ and ops/ are not checked: tests test internals.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Who may import whom. The gateway wires the others and is imported by none: its `__all__`
# is empty.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "engine": frozenset(),
    "tenants": frozenset(),
    "policies": frozenset({"engine"}),
    "billing": frozenset({"tenants"}),
    "migrations": frozenset({"tenants", "billing"}),
    "gateway": frozenset({"engine", "policies", "tenants", "billing", "migrations"}),
}
PACKAGES = tuple(MAY_IMPORT)


@dataclass(frozen=True)
class Violation:
    path: str  # relative to the repository root
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def public_names(package: str) -> frozenset[str]:
    return frozenset(importlib.import_module(package).__all__)


def package_files(package: str) -> Iterator[Path]:
    yield from sorted((ROOT / package).rglob("*.py"))


def check_file(path: Path, package: str) -> list[Violation]:
    """Every import of another project package in path that goes past its public surface or
    that the design does not allow, in line order."""
    return sorted(_check_file(path, package), key=lambda v: v.line)


def _check_file(path: Path, package: str) -> Iterator[Violation]:
    relative = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=relative)
    # Names bound by `import tenants` (or `import tenants as t`): their attributes are checked.
    bound: dict[str, str] = {}

    def imported(target: str, line: int, what: str) -> Iterator[Violation]:
        if target not in MAY_IMPORT[package]:
            yield Violation(relative, line, f"{what}: {package} may not import {target}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target, _, rest = alias.name.partition(".")
                if target not in PACKAGES or target == package:
                    continue
                yield from imported(target, node.lineno, f"import {alias.name}")
                if rest:
                    yield Violation(
                        relative,
                        node.lineno,
                        f"import {alias.name}: {alias.name} is private to {target}; "
                        f"use the names of {target}.__all__",
                    )
                else:
                    bound[alias.asname or target] = target
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            target = node.module.partition(".")[0]
            if target not in PACKAGES or target == package:
                continue
            names = ", ".join(alias.name for alias in node.names)
            statement = f"from {node.module} import {names}"
            yield from imported(target, node.lineno, statement)
            if node.module != target:
                yield Violation(
                    relative,
                    node.lineno,
                    f"{statement}: {node.module} is private to {target}; "
                    f"import from {target} (its __all__)",
                )
                continue
            public = public_names(target)
            for alias in node.names:
                if alias.name not in public:
                    yield Violation(
                        relative,
                        node.lineno,
                        f"{statement}: {alias.name} is not in {target}.__all__",
                    )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            target = bound[node.value.id]
            if node.attr not in public_names(target):
                yield Violation(
                    relative,
                    node.lineno,
                    f"{node.value.id}.{node.attr}: {node.attr} is not in {target}.__all__",
                )


def violations(package: str) -> list[Violation]:
    return [
        violation
        for path in package_files(package)
        for violation in check_file(path, package)
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_stay_behind_public_surfaces(package: str) -> None:
    found = violations(package)
    assert not found, "imports past a package's public surface:\n" + "\n".join(
        str(v) for v in found
    )


@pytest.mark.parametrize(
    "package",
    sorted(
        ".".join(init.relative_to(ROOT).parent.parts)
        for top in PACKAGES
        for init in (ROOT / top).rglob("__init__.py")
    ),
)
def test_every_public_name_exists(package: str) -> None:
    module = importlib.import_module(package)
    if package in PACKAGES:
        assert hasattr(module, "__all__"), f"{package} has no __all__"
    names = list(getattr(module, "__all__", []))
    assert len(names) == len(set(names)), f"{package}.__all__ names something twice"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"


def test_the_check_sees_a_private_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a gateway module that reaches past the engine's facade."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    module = tmp_path / "gateway" / "server" / "example.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "import engine\n"
        "import engine.scheduler\n"
        "from engine import LLMEngine, Scheduler\n"
        "from engine.scheduler import Scheduler as S\n"
        "from gateway.server import settings\n"
        "engine.LLMEngine, engine.scheduler\n"
    )
    found = [str(v) for v in check_file(module, "gateway")]
    assert found == [
        "gateway/server/example.py:2: import engine.scheduler: engine.scheduler is private "
        "to engine; use the names of engine.__all__",
        "gateway/server/example.py:3: from engine import LLMEngine, Scheduler: Scheduler is "
        "not in engine.__all__",
        "gateway/server/example.py:4: from engine.scheduler import Scheduler: "
        "engine.scheduler is private to engine; import from engine (its __all__)",
        "gateway/server/example.py:6: engine.scheduler: scheduler is not in engine.__all__",
    ]
    policies_module = tmp_path / "policies" / "example.py"
    policies_module.parent.mkdir()
    policies_module.write_text("from tenants import Tenant\n")
    assert [str(v) for v in check_file(policies_module, "policies")] == [
        "policies/example.py:1: from tenants import Tenant: policies may not import tenants"
    ]


# The engine's rooms (docs/ARCHITECTURE.md, "The engine's rooms"): each sub-package may import
# the neutral modules, the rooms listed here and nothing else of the engine, so imports run
# one way, from the process down to the kernels. The neutral modules import only each other.
ENGINE_NEUTRAL = frozenset({
    "config", "device_copy", "errors", "grammar_budget", "output_spec", "sampling_params",
    "scheduler_output", "step_outputs", "types",
})
ENGINE_ROOMS: dict[str, frozenset[str]] = {
    "attention": frozenset(),
    "models": frozenset({"attention"}),
    "text": frozenset(),
    "checkpoints": frozenset({"models", "text"}),
    "structured_output": frozenset({"text"}),
    "sample": frozenset(),
    "worker": frozenset({"sample", "models", "attention", "checkpoints"}),
    "core": frozenset({"structured_output", "text"}),
    "process": frozenset({"core", "structured_output", "text"}),
    "testing": frozenset({"worker", "sample", "models", "attention", "checkpoints", "core"}),
}


def engine_part(module: str) -> str | None:
    """The room or neutral module an engine module belongs to (None: the package's facade)."""
    parts = module.split(".")
    if parts[0] != "engine" or len(parts) == 1:
        return None
    if parts[1] not in ENGINE_ROOMS and parts[1] not in ENGINE_NEUTRAL:
        raise AssertionError(f"{module}: in no room and not neutral (ENGINE_ROOMS)")
    return parts[1]


def check_engine_layering(path: Path) -> list[Violation]:
    """Every import in an engine module of a room its own may not import, in line order."""
    relative = path.relative_to(ROOT).with_suffix("")
    own = engine_part(".".join(relative.parts).removesuffix(".__init__"))
    if own is None:
        return []
    allowed = (frozenset() if own in ENGINE_NEUTRAL else ENGINE_ROOMS[own] | {own})
    allowed |= ENGINE_NEUTRAL
    found: list[Violation] = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            target = engine_part(module)
            if target is None or target in allowed:
                continue
            kind = "a neutral module" if own in ENGINE_NEUTRAL else f"engine.{own}"
            found.append(Violation(
                relative.with_suffix(".py").as_posix(), node.lineno,
                f"{module}: {kind} may not import engine.{target}"))
    return sorted(found, key=lambda v: v.line)


def test_the_engine_rooms_import_one_way() -> None:
    found = [v for path in package_files("engine") for v in check_engine_layering(path)]
    assert not found, "imports against the engine's layering:\n" + "\n".join(map(str, found))


def test_the_engine_layering_has_no_cycle() -> None:
    """The rooms form a partial order: no room reaches itself through others."""
    def reach(room: str, seen: frozenset[str]) -> None:
        for lower in ENGINE_ROOMS[room]:
            assert lower not in seen, f"a cycle through engine.{lower}"
            reach(lower, seen | {lower})
    for room in ENGINE_ROOMS:
        reach(room, frozenset({room}))


def test_the_check_sees_a_backward_import(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: the scheduler reaching up into the worker, a neutral module into a
    room, a module in no room."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    core = tmp_path / "engine" / "core" / "example.py"
    core.parent.mkdir(parents=True)
    core.write_text(
        "from engine.types import ModelRunnerOutput\n"
        "from engine.core.kv_cache.kv_manager import KVCacheManager\n"
        "from engine.worker.input_batch import InputBatch\n"
        "import engine.process.engine_loop\n"
    )
    assert [str(v) for v in check_engine_layering(core)] == [
        "engine/core/example.py:3: engine.worker.input_batch: engine.core may not import "
        "engine.worker",
        "engine/core/example.py:4: engine.process.engine_loop: engine.core may not import "
        "engine.process",
    ]
    neutral = tmp_path / "engine" / "types.py"
    neutral.write_text("from engine.sample.sampler import Sampler\n")
    assert [str(v) for v in check_engine_layering(neutral)] == [
        "engine/types.py:1: engine.sample.sampler: a neutral module may not import "
        "engine.sample"
    ]
    stray = tmp_path / "engine" / "stray.py"
    stray.write_text("")
    with pytest.raises(AssertionError, match="in no room"):
        check_engine_layering(stray)
