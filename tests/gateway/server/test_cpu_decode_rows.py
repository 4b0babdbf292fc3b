"""`--cpu-decode-rows` / TIERGATE_CPU_DECODE_ROWS: read, checked, and handed to the runner."""

from __future__ import annotations

import pytest

from engine import CPU_DECODE_MAX_ROWS, TorchModelRunner
from gateway.server.model_spec import ModelSpec
from gateway.server.served_model import build_engine
from gateway.server.settings import GatewaySettings, SettingsError
from policies import TierTable
from tests.serve_process import shared_demo_model_dir


@pytest.mark.parametrize("rows", [-1, CPU_DECODE_MAX_ROWS + 1])
def test_rows_out_of_range_are_refused(rows: int) -> None:
    expected = rf"--cpu-decode-rows must be in 0\.\.{CPU_DECODE_MAX_ROWS}"
    with pytest.raises(SettingsError, match=expected):
        GatewaySettings.from_sources(environ={"TIERGATE_CPU_DECODE_ROWS": str(rows)})


@pytest.mark.parametrize(("environ", "rows"), [({}, CPU_DECODE_MAX_ROWS),
                                               ({"TIERGATE_CPU_DECODE_ROWS": "0"}, 0),
                                               ({"TIERGATE_CPU_DECODE_ROWS": "3"}, 3)])
def test_the_setting_reaches_the_runner(environ: dict[str, str], rows: int) -> None:
    """Unset: the runner's default; 0: no decode forward (and no copy of the weights)."""
    settings = GatewaySettings.from_sources(environ={**environ,
                                                     "TIERGATE_KV_CACHE_BYTES": str(16 << 20)})
    engine = build_engine(settings, TierTable(), ModelSpec(), shared_demo_model_dir())
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    forward = runner.decode_forward
    assert (forward.max_rows if forward is not None else 0) == rows
