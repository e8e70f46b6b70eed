"""The one temp-file / fsync / rename helper every commit step writes through (checkpoint/durable.py)."""

import os
import stat

import pytest

from checkpoint import durable
from checkpoint.durable import durable_replace, durable_write, temp_path


def _record_syscalls(monkeypatch) -> list[tuple[str, str]]:
    """Log ("fsync", "file" | "dir") and ("replace", target name) in call order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    monkeypatch.setattr(durable.os, "replace", replace)
    return events


@pytest.mark.parametrize(
    "data", [b"\x00bytes\xff", "text \u00e9", lambda f: f.write(b"from a writer")], ids=["bytes", "str", "callable"]
)
def test_durable_write_replaces_the_file_whole_and_leaves_no_temp(tmp_path, data):
    path = tmp_path / "record.json"
    path.write_bytes(b"old contents that are longer than the new ones")
    durable_write(path, data)
    expected = data if isinstance(data, bytes) else data.encode() if isinstance(data, str) else b"from a writer"
    assert path.read_bytes() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_durable_write_fsyncs_the_file_before_the_rename_and_the_directory_only_when_asked(tmp_path, monkeypatch):
    events = _record_syscalls(monkeypatch)
    durable_write(tmp_path / "a", b"1")
    assert events == [("fsync", "file"), ("replace", "a")]
    events.clear()
    durable_write(tmp_path / "b", b"2", sync_dir=True)
    assert events == [("fsync", "file"), ("replace", "b"), ("fsync", "dir")]


def test_a_failing_writer_keeps_the_previous_file_and_removes_its_temp(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(b"previous")

    def torn(f):
        f.write(b"half of a pickle")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        durable_write(path, torn)
    assert path.read_bytes() == b"previous"
    assert not temp_path(path).exists()


def test_durable_replace_fsyncs_a_file_written_elsewhere_then_renames_it(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    temp_path(path).write_bytes(b"filled through a memory map")
    events = _record_syscalls(monkeypatch)
    durable_replace(temp_path(path), path)
    assert events == [("fsync", "file"), ("replace", "model.pt")]
    assert path.read_bytes() == b"filled through a memory map"
    assert not temp_path(path).exists()
