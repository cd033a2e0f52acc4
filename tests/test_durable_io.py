"""tenx.utils.io: the one JSON-lines reader (a line a crash cut short is ignored, a damaged one named), the
atomic publish of a streamed file (AtomicOutput) and of a directory (the previous one replaced whole, or put
back)."""

from __future__ import annotations

import os

import pytest

from tenx.errors import DataError, TenxError
from tenx.utils.io import (
    AtomicOutput,
    JsonlTail,
    jsonl_records,
    publish_dir,
    read_jsonl,
    recover_interrupted_publishes,
)


def test_a_torn_last_line_is_ignored_and_a_damaged_one_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2, "loss": NaN}\n{"step": 3, "lo')
    assert [(n, r["step"]) for n, r in jsonl_records(path)] == [(1, 1), (3, 2)]
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')  # terminated: not what a crash leaves
    with pytest.raises(DataError, match=r"m\.jsonl: line 2: not valid JSON .*fix or remove the line"):
        read_jsonl(path)
    assert [r["step"] for r in read_jsonl(path, torn="any")] == [1, 3]  # an append log's next writer
    path.write_text('{"step": 1}\n[2]\n')
    with pytest.raises(DataError, match="line 2: expected a JSON object, got list"):
        read_jsonl(path)
    passed_over: list[int] = []  # a reader that shows what it can: the damaged lines' numbers instead
    assert [r["step"] for _, r in jsonl_records(path, passed_over=passed_over)] == [1] and passed_over == [2]
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")
    assert read_jsonl(tmp_path / "missing.jsonl", missing_ok=True) == []


def test_the_tail_reads_complete_lines_and_stops_at_a_damaged_one(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []
    path.write_text('{"step": 1}\n{"step": 2')
    assert [r["step"] for r in tail.read()] == [1]
    with open(path, "a") as f:
        f.write('}\n{"step": 3}\nnot json\n{"step": 5}\n')
    assert [r["step"] for r in tail.read()] == [1, 2, 3]
    assert tail.error is not None and "line 4: not valid JSON" in tail.error
    path.write_text('{"step": 1}\n')  # truncated (or replaced): read again from the start
    assert [r["step"] for r in tail.read()] == [1] and tail.error is None


def test_publish_replaces_a_directory_whole_and_recovery_puts_an_interrupted_one_back(tmp_path):
    final = tmp_path / "out"
    for content in ("old", "new"):
        tmp = tmp_path / f".out.tmp-{content}"
        tmp.mkdir()
        (tmp / "f").write_text(content)
        publish_dir(tmp, final)
        assert (final / "f").read_text() == content and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    refused = tmp_path / ".out.tmp-refused"
    refused.mkdir()

    def refuse() -> None:
        raise RuntimeError("not ours")

    with pytest.raises(RuntimeError):
        publish_dir(refused, final, before_rename=refuse)
    assert (final / "f").read_text() == "new"
    os.replace(final, tmp_path / ".out.old-123")  # killed between the two renames of a replace
    recover_interrupted_publishes(tmp_path, "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (final / "f").read_text() == "new"


def test_a_streamed_output_appears_whole_or_not_at_all(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with AtomicOutput(path) as f:
        f.write(b"new ")
        assert path.read_bytes() == b"old"  # nothing of it is seen before it is complete
        f.write(b"bytes")
    assert path.read_bytes() == b"new bytes"
    with pytest.raises(RuntimeError), AtomicOutput(path) as f:
        f.write(b"half")
        raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"new bytes" and sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    (tmp_path / "dir").mkdir()
    with pytest.raises(TenxError, match="is a directory, not a regular file"):
        AtomicOutput(tmp_path / "dir")  # refused before anything is written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "out.bin"]
