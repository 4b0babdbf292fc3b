"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from tests.engine import helpers


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Engines from helpers.make_engine schedule synchronously, then asynchronously (the next
    step queued before the previous step's tokens are processed). A test marked step_by_step
    runs synchronously only."""
    if request.param and request.node.get_closest_marker("step_by_step") is not None:
        pytest.skip("reads each step's outputs as that step's: synchronous scheduling only")
    monkeypatch.setattr(helpers, "ASYNC_SCHEDULING", request.param)
    return bool(request.param)
