"""The Files API on a real `tiergate serve` with the official openai SDK, its bytes in a local
directory and in an S3-compatible store (moto's server): upload, list, retrieve, content,
delete; a bad line, a wrong purpose, a file too large and one over the tenant's quota are
refused with nothing kept; another tenant's file is a 404."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import httpx
import openai
import pytest
from moto.server import ThreadedMotoServer

from tests.serve_process import ADMIN_TOKEN, ServeProcess, free_port

MAX_FILE_BYTES = 64 << 10
BUCKET = "tiergate-files"


@dataclass
class Deployment:
    server: ServeProcess
    client: openai.OpenAI
    admin: httpx.Client
    tenant_id: int
    stored: Any  # what the storage holds: a callable giving the stored keys


def _lines(count: int, url: str = "/v1/chat/completions") -> bytes:
    return b"".join(
        json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                    "body": {"model": "tiergate-demo", "max_tokens": 4,
                             "messages": [{"role": "user", "content": f"Say {i}"}]}}
                   ).encode() + b"\n"
        for i in range(count))


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["local", "s3"])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp(f"files-{request.param}")
    env: dict[str, str] = {}
    if request.param == "s3":
        endpoint = request.getfixturevalue("moto_endpoint")
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        setting = f"s3://{BUCKET}/uploads"

        def stored() -> set[str]:
            listing = s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])
            return {item["Key"].rsplit("/", 1)[-1] for item in listing}
    else:
        setting = str(root / "files")

        def stored() -> set[str]:
            return {p.name for p in (root / "files").rglob("file-*")}

    with ServeProcess(f"sqlite:///{root / 'db'}", env=env,
                      args=["--file-storage", setting,
                            "--max-file-bytes", str(MAX_FILE_BYTES)]).start() as server:
        key = server.printed_keys()[0]
        with httpx.Client(base_url=server.base_url,
                          headers={"x-admin-token": ADMIN_TOKEN}) as admin, \
                openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key,
                              max_retries=0) as client:
            [tenant] = admin.get("/admin/v1/tenants").json()["data"]
            yield Deployment(server, client, admin, tenant["id"], stored)


def test_upload_list_retrieve_content_and_delete(deployment: Deployment) -> None:
    client = deployment.client
    content = _lines(3)
    created = client.files.create(file=("requests.jsonl", io.BytesIO(content)),
                                  purpose="batch")
    assert created.id.startswith("file-") and created.bytes == len(content)
    assert created.filename == "requests.jsonl" and created.purpose == "batch"
    assert created.status == "processed"
    assert created.id in deployment.stored()
    assert client.files.retrieve(created.id).bytes == len(content)
    assert client.files.content(created.id).read() == content
    assert created.id in [f.id for f in client.files.list(purpose="batch")]

    deleted = client.files.delete(created.id)
    assert deleted.deleted is True
    assert created.id not in deployment.stored()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)


def test_list_pages_through_the_files_in_order(deployment: Deployment) -> None:
    client = deployment.client
    ids = [client.files.create(file=(f"f{i}.jsonl", io.BytesIO(_lines(1))),
                               purpose="batch").id for i in range(3)]
    try:
        first = client.files.list(limit=2, order="asc", purpose="batch")
        assert first.has_more is True
        seen = [f.id for f in first.data]
        second = client.files.list(limit=2, order="asc", purpose="batch", after=seen[-1])
        seen += [f.id for f in second.data]
        assert [i for i in seen if i in ids] == ids
        newest = client.files.list(limit=1, order="desc")
        assert newest.data[0].id == ids[-1]
    finally:
        for file_id in ids:
            client.files.delete(file_id)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_lines(2) + b"{not json}\n", "line 3 of the file is not valid JSON"),
        (_lines(1) + _lines(1), "line 2 of the file repeats custom_id 'req-0'"),
        (_lines(1, url="/v1/embeddings"), "line 1 of the file needs url"),
        (_lines(1) + b"\n" + _lines(1), "line 2 of the file is empty"),
        (b"\xff\xfe\n", "line 1 of the file is not UTF-8"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                     "body": {"prompt": "x", "stream": True}}).encode(), "asks for a stream"),
        (b"", "the file holds no request"),
    ],
)
def test_a_bad_file_is_refused_naming_its_line_and_nothing_is_kept(
    deployment: Deployment, content: bytes, message: str,
) -> None:
    before = deployment.stored()
    with pytest.raises(openai.BadRequestError) as refused:
        deployment.client.files.create(file=("bad.jsonl", io.BytesIO(content)),
                                       purpose="batch")
    assert message in str(refused.value.message)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "file"
    assert deployment.stored() == before


def test_a_wrong_purpose_or_a_file_too_large_is_refused(deployment: Deployment) -> None:
    client = deployment.client
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("a.jsonl", io.BytesIO(_lines(1))), purpose="fine-tune")
    assert refused.value.code == "unsupported_parameter"
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", io.BytesIO(_lines(700))),
                            purpose="batch")
    assert too_large.value.status_code == 413


def test_the_storage_quota_binds(deployment: Deployment) -> None:
    client, admin = deployment.client, deployment.admin
    content = _lines(2)
    updated = admin.patch(f"/admin/v1/tenants/{deployment.tenant_id}",
                          json={"quota": {"file_storage_bytes": len(content) * 2}})
    assert updated.status_code == 200, updated.text
    kept = []
    try:
        kept = [client.files.create(file=("q.jsonl", io.BytesIO(content)), purpose="batch").id
                for _ in range(2)]
        before = deployment.stored()
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("q.jsonl", io.BytesIO(content)), purpose="batch")
        assert refused.value.code == "storage_quota_exceeded"
        assert deployment.stored() == before
        client.files.delete(kept.pop())
        kept.append(client.files.create(file=("q.jsonl", io.BytesIO(content)),
                                        purpose="batch").id)
    finally:
        for file_id in kept:
            client.files.delete(file_id)
        admin.patch(f"/admin/v1/tenants/{deployment.tenant_id}",
                    json={"quota": {"file_storage_bytes": None}})


def test_another_tenants_file_is_a_404(deployment: Deployment) -> None:
    admin = deployment.admin
    tenant = admin.post("/admin/v1/tenants", json={"name": "other", "tier": "standard"})
    assert tenant.status_code == 201, tenant.text
    key = admin.post(f"/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "k"})
    mine = deployment.client.files.create(file=("m.jsonl", io.BytesIO(_lines(1))),
                                          purpose="batch")
    with openai.OpenAI(base_url=f"{deployment.server.base_url}/v1",
                       api_key=key.json()["key"], max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(mine.id)
        with pytest.raises(openai.NotFoundError):
            other.files.delete(mine.id)
        assert mine.id not in [f.id for f in other.files.list()]
    assert deployment.client.files.retrieve(mine.id).id == mine.id
    deployment.client.files.delete(mine.id)
