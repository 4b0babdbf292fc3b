"""LoRA adapters as tenant resources, end to end: a real `tiergate serve` (demo model) on
PostgreSQL, adapters made with PEFT, registered through the admin API, called with the
official openai SDK.

The owner's requests run on the adapter (PEFT's greedy tokens), the base model's do not,
another tenant gets the 404 of a name nobody registered; bad adapters are refused with a 400
naming the problem and nothing is stored; sharing, pinning (with the CLI), usage records, the
audit log, unregistering; and a second replica on the same database, with an empty model
cache, serves the adapter (the registry and the files live in the database).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from engine import Tokenizer
from tests.adapter_archive import adapter_tar_gz
from tests.engine.models.helpers import hf_greedy, make_checkpoint
from tests.engine.models.lora_adapters import Adapter, make_adapter
from tests.serve_process import ADMIN_TOKEN, ServeProcess, shared_demo_model_dir
from tests.tenants.conftest import scratch_database

MODEL = "tiergate-demo"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scratch_database("postgresql", tmp_path_factory.mktemp("pg")) as url:
        yield url


def _replica(database: str, cache: Path) -> ServeProcess:
    return ServeProcess(database, env={"TIERGATE_MODEL_CACHE_DIR": str(cache)},
                        args=["--max-lora-rank", "32"])


@pytest.fixture(scope="module")
def server(database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with _replica(database, tmp_path_factory.mktemp("cache")).start() as process:
        yield process


@pytest.fixture(scope="module")
def admin(server: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.base_url}/admin/v1",
                      headers={"x-admin-token": ADMIN_TOKEN}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def keys(admin: httpx.Client) -> dict[str, str]:
    """An API key of each of two tenants, alpha (the owner) and beta."""
    made = {}
    for name in ("alpha", "beta"):
        assert admin.post("/tenants", json={"name": name}).status_code == 201
        made[name] = admin.post(f"/tenants/{name}/keys", json={}).json()["key"]
    return made


def _sdk(server: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Adapter:
    return make_adapter(shared_demo_model_dir(), tmp_path_factory.mktemp("a") / "french", 16,
                        seed=3)


def _upload(admin: httpx.Client, name: str, data: bytes, owner: str = "alpha",
            shared: str = "") -> httpx.Response:
    return admin.post("/adapters", content=data, headers={"content-type": "application/gzip"},
                      params={"name": name, "owner": owner, "shared_with": shared})


def _greedy(client: openai.OpenAI, model: str, max_tokens: int = 12) -> tuple[str, Any]:
    reply = client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                      max_tokens=max_tokens, extra_body={"ignore_eos": True})
    return reply.choices[0].text, reply


@pytest.fixture(scope="module")
def registered(admin: httpx.Client, keys: dict[str, str], adapter: Adapter) -> dict[str, Any]:
    response = _upload(admin, "french", adapter_tar_gz(Path(adapter.lora.path)))
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_the_owner_runs_on_the_adapter_and_others_see_nothing(
    server: ServeProcess, keys: dict[str, str], adapter: Adapter, registered: dict[str, Any]
) -> None:
    assert registered["rank"] == 16 and len(registered["targets"]) == 7
    with _sdk(server, keys["alpha"]) as alpha, _sdk(server, keys["beta"]) as beta:
        assert [m.id for m in alpha.models.list().data] == [MODEL, "french"]
        assert alpha.models.retrieve("french").id == "french"
        assert [m.id for m in beta.models.list().data] == [MODEL]

        text, reply = _greedy(alpha, "french")
        assert reply.model == "french"
        tokenizer = Tokenizer.from_dir(shared_demo_model_dir())
        prompt_ids = tokenizer.encode(PROMPT)
        expected = hf_greedy(adapter.reference, prompt_ids, 12)
        assert text == tokenizer.decode(expected)  # PEFT's tokens, through the gateway
        assert _greedy(alpha, f"{MODEL}:french")[0] == text
        assert _greedy(alpha, MODEL)[0] != text  # the base model is unchanged

        unknown = _error(lambda: _greedy(beta, "no-such-adapter"))
        hidden = _error(lambda: _greedy(beta, "french"))
        assert unknown.status_code == hidden.status_code == 404
        assert (unknown.body["message"].replace("no-such-adapter", "X")  # type: ignore[index]
                == hidden.body["message"].replace("french", "X"))  # type: ignore[index]
        assert _error(lambda: beta.models.retrieve("french")).status_code == 404


def _error(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


def _adapter_count(admin: httpx.Client) -> int:
    return len(admin.get("/adapters").json()["data"])


@pytest.fixture(scope="module")
def other_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter made for another base model (the tiny test llama: other shapes)."""
    base = tmp_path_factory.mktemp("other-base")
    make_checkpoint(base, "llama", seed=5)
    return Path(make_adapter(base, tmp_path_factory.mktemp("o") / "other", 8, seed=1).lora.path)


def test_bad_adapters_are_refused_and_nothing_is_stored(
    admin: httpx.Client, registered: dict[str, Any], adapter: Adapter, other_base: Path,
    tmp_path: Path, database: str,
) -> None:
    directory = Path(adapter.lora.path)
    big = make_adapter(shared_demo_model_dir(), tmp_path / "big", 64, seed=4)
    cases = {
        "pickle": (adapter_tar_gz(directory, {"adapter_model.bin": pickle.dumps({"w": [1.0]})},
                            skip=("adapter_model.safetensors",)), "is a pickle"),
        "wrong base": (adapter_tar_gz(other_base), "is the adapter for another base model"),
        "rank": (adapter_tar_gz(Path(big.lora.path)), "rank 64 is above the limit of 32"),
        "not an archive": (b"\x00garbage" * 100, "neither a zip nor a tar"),
        "missing weights": (adapter_tar_gz(directory, skip=("adapter_model.safetensors",)),
                            "adapter_model.safetensors is missing"),
        "escape": (adapter_tar_gz(directory, {"../evil.json": b"{}"}), "is not a file at the"),
    }
    before = _adapter_count(admin)
    for case, (data, message) in cases.items():
        response = _upload(admin, f"bad-{case.replace(' ', '-')}", data)
        assert response.status_code == 400, (case, response.text)
        assert message in response.json()["error"]["message"], case
    json_path = admin.post("/adapters", json={"name": "bad-path", "owner": "alpha",
                                              "path": str(tmp_path / "nowhere")})
    assert json_path.status_code == 400 and "is not a directory" in json_path.text
    duplicate = _upload(admin, "french", adapter_tar_gz(directory))
    assert duplicate.status_code == 409
    assert _adapter_count(admin) == before
    db = create_engine(database)
    with db.connect() as connection:
        blobs = connection.execute(text("SELECT count(*) FROM lora_adapter_blobs")).scalar()
    db.dispose()
    assert blobs == before  # one content per registered adapter, nothing from the refusals


def test_sharing_usage_records_and_unregistering(
    server: ServeProcess, admin: httpx.Client, keys: dict[str, str], adapter: Adapter,
    registered: dict[str, Any], database: str,
) -> None:
    response = admin.post("/adapters", json={"name": "french-shared", "owner": "alpha",
                                             "shared_with": ["beta"], "path": adapter.lora.path})
    assert response.status_code == 201, response.text
    # The CLI pins it (over the admin API): the engine keeps it on the host once loaded.
    pinned = _cli(server, "pin", "french-shared")
    assert pinned["pinned"] is True and pinned["name"] == "french-shared"
    listed = _cli(server, "list", "--owner", "beta")
    assert [(a["name"], a["pinned"]) for a in listed["data"]] == [("french-shared", True)]
    with _sdk(server, keys["beta"]) as beta:
        assert [m.id for m in beta.models.list().data] == [MODEL, "french-shared"]
        _greedy(beta, "french-shared", max_tokens=3)
    assert _cli(server, "unpin", "french-shared")["pinned"] is False
    db = create_engine(database)
    with db.connect() as connection:
        adapters = connection.execute(text(
            "SELECT adapter, model FROM usage_records WHERE adapter = 'french-shared'")).all()
    assert adapters == [("french-shared", MODEL)]
    assert admin.patch("/adapters/french-shared", json={"shared_with": []}).status_code == 200
    removed = admin.delete("/adapters/french-shared")
    assert removed.status_code == 200 and removed.json()["deleted"] is True
    assert admin.get("/adapters/french-shared").status_code == 404
    with _sdk(server, keys["alpha"]) as alpha:
        assert _error(lambda: _greedy(alpha, "french-shared")).status_code == 404
        assert _greedy(alpha, "french", max_tokens=2)  # same content, still registered
    actions = [e["action"] for e in admin.get("/audit").json()["data"]
               if e["target_type"] == "lora_adapter"]
    for action in ("lora_adapter.create", "lora_adapter.share", "lora_adapter.pin",
                   "lora_adapter.unpin", "lora_adapter.unregister", "lora_adapter.delete"):
        assert action in actions
    db.dispose()


def _cli(server: ServeProcess, *args: str) -> dict[str, Any]:
    """`tiergate adapters ...` against the server, its --json output."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "adapters", *args, "--url", server.base_url,
         "--json"],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "TIERGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_a_second_replica_serves_the_adapter_from_the_database(
    database: str, keys: dict[str, str], registered: dict[str, Any], server: ServeProcess,
    tmp_path: Path,
) -> None:
    with _sdk(server, keys["alpha"]) as first:
        expected = _greedy(first, "french", max_tokens=8)[0]
    with _replica(database, tmp_path / "empty-cache").start() as second, \
            _sdk(second, keys["alpha"]) as alpha:
        assert _greedy(alpha, "french", max_tokens=8)[0] == expected
    assert (tmp_path / "empty-cache" / "adapters" / registered["content_hash"]).is_dir()
