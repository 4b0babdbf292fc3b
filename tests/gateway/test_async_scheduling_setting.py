"""`--async-scheduling` / TIERGATE_ASYNC_SCHEDULING: read, checked, and handed to the engine."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser
from gateway.server.served_model import build_engine
from gateway.server.settings import GatewaySettings, SettingsError
from policies import TierTable
from tests.serve_process import shared_demo_model_dir


def test_a_value_other_than_auto_on_off_is_refused() -> None:
    with pytest.raises(SettingsError, match="--async-scheduling must be auto, on or off"):
        GatewaySettings.from_sources(environ={"TIERGATE_ASYNC_SCHEDULING": "yes"})


@pytest.mark.parametrize(("environ", "expected"), [({}, False),
                                                   ({"TIERGATE_ASYNC_SCHEDULING": "on"}, True),
                                                   ({"TIERGATE_ASYNC_SCHEDULING": "off"}, False)])
def test_the_setting_reaches_the_engine(environ: dict[str, str], expected: bool) -> None:
    """auto: the runner decides (on the CPU its steps are done when execute returns: off)."""
    settings = GatewaySettings.from_sources(environ={**environ,
                                                     "TIERGATE_KV_CACHE_BYTES": str(16 << 20)})
    engine = build_engine(settings, TierTable(), shared_demo_model_dir())
    assert engine.async_scheduling is expected


def test_the_flag_wins_over_the_environment() -> None:
    args = build_parser().parse_args(["serve", "--async-scheduling", "on"])
    settings = GatewaySettings.from_sources(args, environ={"TIERGATE_ASYNC_SCHEDULING": "off"})
    assert settings.async_scheduling == "on"
