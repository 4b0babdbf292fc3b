"""The LoRA flags (`--max-loras`, `--max-cpu-loras`, `--max-lora-rank`,
`--max-adapter-bytes`): read, checked, and handed to the engine."""

from __future__ import annotations

import pytest

from engine import TorchModelRunner
from gateway.server.model_spec import ModelSpec
from gateway.server.served_model import build_engine
from gateway.server.settings import GatewaySettings, SettingsError
from policies import TierTable
from tests.serve_process import shared_demo_model_dir


@pytest.mark.parametrize(("environ", "message"), [
    ({"TIERGATE_MAX_LORAS": "-1"}, "--max-loras must be >= 0"),
    ({"TIERGATE_MAX_LORAS": "8", "TIERGATE_MAX_CPU_LORAS": "4"}, "--max-cpu-loras at least"),
    ({"TIERGATE_MAX_LORA_RANK": "0"}, "--max-lora-rank and --max-adapter-bytes must be >= 1"),
])
def test_bad_values_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        GatewaySettings.from_sources(environ=environ)


@pytest.mark.parametrize("environ", [
    {},
    {"TIERGATE_MAX_LORAS": "2", "TIERGATE_MAX_CPU_LORAS": "3", "TIERGATE_MAX_LORA_RANK": "8"},
    {"TIERGATE_MAX_LORAS": "0"},
])
def test_the_settings_reach_the_runner(environ: dict[str, str]) -> None:
    settings = GatewaySettings.from_sources(environ={**environ,
                                                     "TIERGATE_KV_CACHE_BYTES": str(16 << 20)})
    engine = build_engine(settings, TierTable(), ModelSpec(), shared_demo_model_dir())
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    if settings.max_loras == 0:
        assert runner.lora is None
        return
    assert runner.lora is not None
    config = runner.lora.config
    assert (config.max_loras, config.max_cpu_loras, config.max_lora_rank) == (
        settings.max_loras, settings.max_cpu_loras, settings.max_lora_rank)
    assert runner.lora.slots.num_slots == settings.max_loras
