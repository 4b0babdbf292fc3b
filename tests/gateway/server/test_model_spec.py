"""The served models from repeated --model/--served-model-name or the config file's models
section: pairing, names, refusals, and each model's part of the KV memory."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.server.model_source import DEFAULT_MODEL_NAME, DEMO_MODEL_NAME
from gateway.server.model_spec import ModelSpec, placed_specs
from gateway.server.settings import GatewaySettings, SettingsError, add_arguments


def _settings(argv: list[str], environ: dict[str, str] | None = None) -> GatewaySettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return GatewaySettings.from_sources(parser.parse_args(argv), environ or {})


def test_repeated_flags_pair_models_with_their_names() -> None:
    assert _settings([]).models == (ModelSpec(),)
    assert _settings([]).models[0].served_name == DEFAULT_MODEL_NAME
    two = _settings(["--model", "default", "--model", "demo"]).models
    assert [m.served_name for m in two] == [DEFAULT_MODEL_NAME, DEMO_MODEL_NAME]
    named = _settings(["--model", "demo", "--served-model-name", "small",
                       "--model", "/ckpt/llama-3", "--served-model-name", "big"]).models
    assert [(m.source, m.served_name) for m in named] == [("demo", "small"),
                                                         ("/ckpt/llama-3", "big")]
    assert _settings([], {"TIERGATE_MODEL": "demo"}).models == (ModelSpec(source="demo"),)
    # A flag wins over the variable.
    assert _settings(["--model", "default"], {"TIERGATE_MODEL": "demo"}).models == (
        ModelSpec(source="default"),)


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "demo", "--model", "demo"], "two models are served as 'tiergate-demo'"),
    (["--model", "demo", "--model", "default", "--served-model-name", "x"],
     "1 --served-model-name for 2 --model"),
    (["--model", "demo", "--served-model-name", "a:b"], "without whitespace or ':'"),
])
def test_inconsistent_models_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match="--model") as refused:
        _settings(argv)
    assert message in str(refused.value)


def test_the_config_file_lists_models_with_their_own_budgets(tmp_path: Path) -> None:
    config = tmp_path / "tiergate.yaml"
    config.write_text(
        "models:\n"
        "  - {name: small}\n"
        "  - {model: demo, kv_cache_bytes: 1048576, max_model_len: 512, device: cpu,"
        " dtype: bfloat16}\n"
    )
    models = _settings(["--config", str(config)]).models
    assert models == (ModelSpec(name="small"),
                      ModelSpec(source="demo", kv_cache_bytes=1 << 20, max_model_len=512,
                                device="cpu", dtype="bfloat16"))
    config.write_text("models:\n  - {model: demo, device: tpu}\n")
    with pytest.raises(SettingsError, match="device must be cpu, cuda or cuda:N"):
        _settings(["--config", str(config)])
    with pytest.raises(SettingsError, match="not both"):
        _settings(["--config", str(config), "--model", "demo"])
    config.write_text("models:\n  - {model: demo, kv_cache: 1}\n")
    with pytest.raises(SettingsError, match=r"models\[0\]: unknown keys \['kv_cache'\]"):
        _settings(["--config", str(config)])
    config.write_text("models: []\n")
    with pytest.raises(SettingsError, match="non-empty list"):
        _settings(["--config", str(config)])


def test_models_without_budgets_share_the_kv_memory() -> None:
    specs = [ModelSpec(source="demo"), ModelSpec()]
    assert [s.kv_memory_scale for s in placed_specs(specs, "cpu")] == [0.5, 0.5]
    # On CUDA the engines load in turn and each sees the earlier ones' memory as in use.
    assert [s.kv_memory_scale for s in placed_specs(specs, "cuda:0")] == [0.5, 1.0]
    assert placed_specs(specs[:1], "cpu") == specs[:1]
    own = [ModelSpec(source="demo", kv_cache_bytes=1 << 20), ModelSpec()]
    assert placed_specs(own, "cpu") == own
    # Models on devices of their own take the whole of each; "cuda" is "cuda:0".
    apart = [ModelSpec(source="demo", device="cuda:1"), ModelSpec(), ModelSpec(source="x")]
    assert [s.kv_memory_scale for s in placed_specs(apart, "cuda")] == [1.0, 0.5, 1.0]
