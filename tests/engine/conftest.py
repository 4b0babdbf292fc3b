"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.engine import helpers

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Engines from helpers.make_engine schedule synchronously, then asynchronously (the next
    step queued before the previous step's tokens are processed). A test marked step_by_step
    runs synchronously only."""
    if request.param and request.node.get_closest_marker("step_by_step") is not None:
        pytest.skip("reads each step's outputs as that step's: synchronous scheduling only")
    monkeypatch.setattr(helpers, "ASYNC_SCHEDULING", request.param)
    return bool(request.param)


@pytest.fixture(scope="module")
def llama(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel]:
    """A tiny random llama checkpoint (models/helpers.py's make_checkpoint) and the HF model it
    holds, written once per test module with the seed the module sets as LLAMA_SEED (else 0)."""
    # Imported here: transformers takes seconds to import, and most engine tests need no model.
    from tests.engine.models.helpers import make_checkpoint

    path = tmp_path_factory.mktemp("llama")
    return path, make_checkpoint(path, "llama", seed=getattr(request.module, "LLAMA_SEED", 0))
