"""Uploaded adapter archives: the two files are taken from a zip or a tar at its root or one
directory down; everything else is refused by name before it is kept."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile

import pytest

from engine import AdapterError
from gateway.adapters import AdapterStore, content_hash, read_archive
from gateway.adapters.archive import AdapterFiles

CONFIG = b'{"r": 8, "lora_alpha": 16}'
WEIGHTS = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "


def _tar(members: dict[str, bytes], mode: str = "w:gz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:  # type: ignore[call-overload]
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


GOOD = {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS}


@pytest.mark.parametrize("pack", [
    lambda m: _tar(m), lambda m: _tar(m, "w:bz2"), lambda m: _tar(m, "w:xz"),
    lambda m: _tar(m, "w"), _zip,
], ids=["tar.gz", "tar.bz2", "tar.xz", "tar", "zip"])
def test_every_archive_kind_at_the_root_or_in_one_directory(pack: object) -> None:
    for prefix in ("", "my-adapter/"):
        members = {prefix + k: v for k, v in GOOD.items()} | {prefix + "README.md": b"# hi"}
        files = read_archive(pack(members), max_bytes=1 << 20)  # type: ignore[operator]
        assert files == AdapterFiles(CONFIG, WEIGHTS)


@pytest.mark.parametrize(("members", "message"), [
    ({**GOOD, "adapter_model.bin": b"pickle"}, "is a pickle"),
    ({"adapter_config.json": CONFIG}, "adapter_model.safetensors is missing"),
    ({"adapter_model.safetensors": WEIGHTS}, "adapter_config.json is missing"),
    ({**GOOD, "../x/adapter_config.json": CONFIG}, "is not a file at the archive's root"),
    ({**GOOD, "/etc/adapter_config.json": CONFIG}, "is not a file at the archive's root"),
    ({**GOOD, "a/b/adapter_config.json": CONFIG}, "is not a file at the archive's root"),
    ({**GOOD, "training_args.bin": b"x"}, "is not part of a PEFT LoRA adapter"),
    ({**GOOD, "a/adapter_config.json": CONFIG}, "holds adapter_config.json twice"),
])
def test_refusals_name_the_member(members: dict[str, bytes], message: str) -> None:
    for pack in (_tar, _zip):
        with pytest.raises(AdapterError, match=message.replace("(", r"\(")):
            read_archive(pack(members), max_bytes=1 << 20)


def test_links_are_refused() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
        config = tarfile.TarInfo("adapter_config.json")
        config.size = len(CONFIG)
        tar.addfile(config, io.BytesIO(CONFIG))
    with pytest.raises(AdapterError, match="is not a file"):
        read_archive(buffer.getvalue(), max_bytes=1 << 20)
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as archive:
        link = zipfile.ZipInfo("adapter_model.safetensors")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(link, "/etc/passwd")
        archive.writestr("adapter_config.json", CONFIG)
    with pytest.raises(AdapterError, match="is not a file"):
        read_archive(zipped.getvalue(), max_bytes=1 << 20)


def test_a_compressed_bomb_stops_at_the_limit() -> None:
    bomb = {"adapter_config.json": CONFIG, "adapter_model.safetensors": b"\0" * (64 << 20)}
    for pack in (_tar, _zip):
        data = pack(bomb)
        assert len(data) < 1 << 20  # a small upload
        with pytest.raises(AdapterError, match="over the limit of 1048576 bytes"):
            read_archive(data, max_bytes=1 << 20)


def test_garbage_is_refused() -> None:
    with pytest.raises(AdapterError, match="neither a zip nor a tar"):
        read_archive(b"\x00not an archive" * 64, max_bytes=1 << 20)


def test_the_store_keeps_one_checked_directory_per_content(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path))
    store = AdapterStore(root / "adapters")
    files = AdapterFiles(CONFIG, WEIGHTS)
    digest = content_hash(files)
    path = store.write(digest, files)
    assert store.has(digest) and path == root / "adapters" / digest
    assert (path / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert store.write(digest, files) == path  # written once
    with pytest.raises(ValueError, match="do not match their content hash"):
        store.write(digest, AdapterFiles(CONFIG, WEIGHTS + b"x"))
    assert content_hash(AdapterFiles(CONFIG + WEIGHTS[:1], WEIGHTS[1:])) != digest
    assert sorted(p.name for p in (root / "adapters").iterdir()) == [digest]  # no staging left
