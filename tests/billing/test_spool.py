"""The spool file: fsync'd appends read back in order, chunked reads, a torn last line after a
crash, unreadable lines kept aside rather than lost."""

from __future__ import annotations

import json
from pathlib import Path

from billing.spool import Spool
from tests.billing.factories import make_record


def test_appended_records_read_back_in_order_in_chunks(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    assert spool.is_empty()
    records = [make_record(f"r{i}", tenant_id=i) for i in range(7)]
    spool.append(records[:3])
    spool.append(records[3:])

    first = spool.read_chunk(0, max_records=4)
    second = spool.read_chunk(first.next_offset, max_records=4)
    assert first.records == records[:4] and not first.is_end
    assert second.records == records[4:] and second.is_end
    assert second.next_offset == (tmp_path / "spool.jsonl").stat().st_size

    spool.truncate()
    assert spool.is_empty()
    assert spool.read_chunk(0, max_records=4).records == []


def test_a_torn_last_line_is_ended_so_later_appends_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    spool = Spool(path)
    spool.append([make_record("kept")])
    with path.open("ab") as file:  # a crash in the middle of the next append
        file.write(json.dumps(make_record("torn").to_json()).encode()[:40])

    # Before recovery the torn line is not read as a record (and nothing was acknowledged).
    assert [r.request_id for r in spool.read_chunk(0, 10).records] == ["kept"]

    spool.recover()
    spool.append([make_record("after")])
    chunk = spool.read_chunk(0, 10)
    assert [r.request_id for r in chunk.records] == ["kept", "after"]
    assert len(chunk.rejected_lines) == 1 and chunk.rejected_lines[0].startswith(b'{"request_id')

    spool.reject(chunk.rejected_lines)
    assert spool.rejected_path.read_bytes() == chunk.rejected_lines[0]


def test_recover_leaves_a_clean_spool_alone(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    spool = Spool(path)
    spool.recover()  # no file yet
    spool.append([make_record("a")])
    before = path.read_bytes()
    spool.recover()
    assert path.read_bytes() == before
