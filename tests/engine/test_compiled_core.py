"""The compiled build's module list, and which build the tests run on: `make test-compiled`
sets TIERGATE_EXPECT_COMPILED=1 and must find every listed module a C extension; the
ordinary run must find none."""

from __future__ import annotations

import os
from pathlib import Path

import engine
from engine.compiled_core import MODULES, compiled_modules, core_name, is_compiled

_ROOT = Path(engine.__file__).parent.parent


def test_every_listed_module_is_an_engine_module_of_its_own() -> None:
    assert len(set(MODULES)) == len(MODULES)
    for path in MODULES:
        assert path.startswith("engine/") and path.endswith(".py")
        assert (_ROOT / path).is_file(), path


def test_the_tests_run_on_the_build_they_expect() -> None:
    expect_compiled = os.environ.get("TIERGATE_EXPECT_COMPILED") == "1"
    assert is_compiled() is expect_compiled
    assert len(compiled_modules()) == (len(MODULES) if expect_compiled else 0)
    assert core_name() == ("compiled (mypyc)" if expect_compiled else "pure Python")
    # No engine module compiled but the listed ones: an extension left from an earlier list
    # would shadow its module's source.
    extensions = sorted(
        f"engine/{p.name.split('.')[0]}.py" for p in (_ROOT / "engine").glob("*.so")
    )
    assert extensions == (sorted(MODULES) if expect_compiled else [])
