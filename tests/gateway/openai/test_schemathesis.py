"""schemathesis against OpenAI's own spec (createChatCompletion, createCompletion,
listModels, createResponse) on a real `tiergate serve`: no 5xx and no response-schema
violation."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serve_process import ServeProcess

SPEC = Path(__file__).parents[1] / "openai_spec" / "openai-subset.json"
MODEL = "tiergate-demo"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    db = tmp_path_factory.mktemp("schemathesis") / "tiergate.db"
    # A short context keeps the fuzzer's n=128, max_tokens=huge requests cheap on a CPU.
    with ServeProcess(f"sqlite:///{db}", args=["--max-model-len", "128"]).start() as process:
        yield process


def _spec_for_served_model(directory: Path) -> Path:
    """The spec with `model` pinned to the served model, so generated bodies reach the
    engine instead of stopping at 404 (unknown models are covered by the SDK tests)."""
    spec = json.loads(SPEC.read_text())
    schemas = spec["components"]["schemas"]
    pinned = {"type": "string", "enum": [MODEL]}
    for part in schemas["CreateChatCompletionRequest"]["allOf"]:
        if "model" in part.get("properties", {}):
            part["properties"]["model"] = pinned
    schemas["CreateCompletionRequest"]["properties"]["model"] = pinned
    schemas["ResponseProperties"]["properties"]["model"] = pinned
    path = directory / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def test_no_server_errors_and_responses_match_the_spec(
    server: ServeProcess, tmp_path: Path
) -> None:
    key = server.printed_keys()[0]
    spec = _spec_for_served_model(tmp_path)
    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("st")), "run", str(spec),
            "--url", f"{server.base_url}/v1",
            "-H", f"Authorization: Bearer {key}",
            "--checks", "not_a_server_error,response_schema_conformance",
            "--max-examples", "30",
            "--seed", "20261121",
            "--request-timeout", "120",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Traceback" not in server.output()
    # The fuzzer must have reached the engine, not only the validators.
    metrics = httpx.get(f"{server.base_url}/metrics").text
    completed = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tiergate_requests_total{") and 'status="completed"' in line
    )
    assert completed >= 5, metrics
