"""The checkpoint library reaches the file system only through its storage interface (checkpoint/storage_backend.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.errors import CheckpointCorruptError
from checkpoint.storage_backend import LOCAL, LocalStorage, Storage, mount, storage_for, unmount

REPO = Path(__file__).resolve().parents[1]

# The library modules whose file-system use goes through checkpoint.storage_backend.
ROUTED = ["atomic", "commit", "content_check", "data_file", "dcp_metadata", "manifest", "opener", "reader", "storage"]
# The local implementation itself: LocalStorage and its durable small-file replace.
IMPLEMENTATION = ["storage_backend", "durable"]

FILE_SYSTEM_CALLS = re.compile(
    r"\bos\.(open|fdopen|fsync|replace|rename|stat|lstat|fstat|unlink|remove|rmdir|mkdir|makedirs|listdir|scandir"
    r"|preadv|pread|pwrite|link|symlink|readlink|truncate|posix_fallocate)\b"
    r"|\bos\.path\.(exists|lexists|isdir|isfile|islink|getsize|realpath)\b"
    r"|(?<![\w.])open\("
    r"|\.(iterdir|unlink|mkdir|rmdir|exists|is_file|is_dir|is_symlink|read_text|write_text|read_bytes|write_bytes"
    r"|stat|lstat|touch|rename|glob|rglob|resolve|readlink|symlink_to|hardlink_to)\("  # not .replace(: str, dataclasses
    r"|\b(shutil|fcntl|mmap)\."
    r"|\bsync_file_range\b|(?<!def )\bopen_regular\("
)


# Calls on a storage (storage_for(p).stat(...), store.rename(...)) are the interface, whatever their names.
_STORAGE_CALL = re.compile(r"(storage_for\([^()]*\)|\bstore|self\._store|\bLOCAL)\.\w+\(")


def _code_lines(path: Path):
    """(number, line) of a module's code, comments and docstrings left out (they may name the calls)."""
    in_doc = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""')
        if in_doc or stripped.startswith('"""'):
            in_doc = in_doc != (quotes % 2 == 1)
            continue
        yield number, _STORAGE_CALL.sub("(", line.split(" #", 1)[0])


@pytest.mark.parametrize("module", ROUTED)
def test_library_module_calls_the_file_system_only_through_the_storage_interface(module):
    path = REPO / "checkpoint" / f"{module}.py"
    found = [f"{path.name}:{n}: {line.strip()}" for n, line in _code_lines(path) if FILE_SYSTEM_CALLS.search(line)]
    assert not found, "file-system calls outside checkpoint/storage_backend.py:\n" + "\n".join(found)


def test_the_grep_finds_the_calls_it_forbids():
    # The implementation modules do call the file system: the pattern must see them, or the test above proves nothing.
    for module in IMPLEMENTATION:
        lines = [line for _, line in _code_lines(REPO / "checkpoint" / f"{module}.py")]
        assert any(FILE_SYSTEM_CALLS.search(line) for line in lines), module
    for call in ("os.replace(a, b)", "p.iterdir()", "open(p, 'wb')", "shutil.rmtree(p)", "os.path.lexists(p)"):
        assert FILE_SYSTEM_CALLS.search(call), call
    for allowed in ("storage_for(p).stat(p)", "store.rename(a, b)", "os.path.abspath(p)", "os.PathLike"):
        assert not FILE_SYSTEM_CALLS.search(_STORAGE_CALL.sub("(", allowed)), allowed


def test_every_library_module_is_either_routed_implementation_or_free_of_file_system_calls():
    # A new library module that touches files must be added to ROUTED (and route) or be the implementation.
    known = set(ROUTED) | set(IMPLEMENTATION)
    for path in sorted((REPO / "checkpoint").glob("*.py")):
        if path.stem in known:
            continue
        hits = [n for n, line in _code_lines(path) if FILE_SYSTEM_CALLS.search(line)]
        if path.stem in _TOOL_MODULES:
            continue  # the fsdp-ckpt tool's own import / export files are not the format library
        assert not hits, f"checkpoint/{path.name} lines {hits} call the file system: go through storage_for(path)"


# The tool's modules (checkpoint/tool/ once moved) write foreign formats with their own files.
_TOOL_MODULES = {
    "cli",
    "cli_convert",
    "cli_diff",
    "cli_inspect",
    "cli_parallel",
    "cli_report",
    "cli_source",
    "rewrite",
    "safetensors_io",
    "stream",
    "torchfile_io",
    "transforms",
}


def test_local_storage_is_a_storage_and_every_path_is_local_by_default(tmp_path):
    assert isinstance(LOCAL, LocalStorage)
    assert all(callable(getattr(LOCAL, name)) for name in _protocol_methods())
    assert storage_for(tmp_path / "ck") is LOCAL


def _protocol_methods() -> list[str]:
    return [name for name in vars(Storage) if not name.startswith("_")]


class _CountingStorage(LocalStorage):
    """The local file system, counting every interface call: a second backend, mounted on one directory."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name: str):
        if name in _protocol_methods():
            calls = object.__getattribute__(self, "calls")
            calls[name] = calls.get(name, 0) + 1
        return object.__getattribute__(self, name)


def test_a_mounted_backend_carries_a_whole_save_and_load_and_unmounted_paths_stay_local(tmp_path):
    backend = _CountingStorage()
    root = tmp_path / "mounted"
    mount(root, backend)
    try:
        assert storage_for(root / "ck" / "manifest.json") is backend
        assert storage_for(tmp_path / "elsewhere") is LOCAL
        state = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
        checkpoint.save_state_dict(state, root / "ck")
        target = {"w": torch.zeros(3, 4), "step": None}
        checkpoint.load_state_dict(target, root / "ck")
    finally:
        unmount(root)
    assert torch.equal(target["w"], state["w"]) and target["step"] == 7
    # writes, the commit primitives and the reads all went through the mounted backend
    for name in ("lock", "make_dir", "create", "write_file", "rename", "sync_dir", "open_read", "read_into", "stat"):
        assert backend.calls.get(name, 0) > 0, f"{name} never reached the mounted backend: {backend.calls}"
    assert storage_for(root / "ck") is LOCAL


def test_local_open_read_refuses_a_fifo_and_a_symbolic_link_without_blocking(tmp_path):
    real = tmp_path / "real"
    real.write_bytes(b"data")
    (tmp_path / "link").symlink_to(real)
    os.mkfifo(tmp_path / "fifo")
    for name, kind in (("link", "a symbolic link"), ("fifo", "a FIFO")):
        with pytest.raises(CheckpointCorruptError, match=kind):
            LOCAL.open_read(tmp_path / name)
    with LOCAL.open_read(tmp_path / "link", follow_symlinks=True) as f:
        assert f.read() == b"data"


def test_local_read_into_fills_buffers_in_order_and_reports_a_short_read(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(10)))
    head, body = bytearray(3), bytearray(5)
    with LOCAL.open_read(path) as f:
        assert LOCAL.read_into(f, [head, body], 1) == 8
        assert bytes(head) == bytes([1, 2, 3]) and bytes(body) == bytes([4, 5, 6, 7, 8])
        assert LOCAL.read_into(f, [bytearray(4)], 8) == 2


def test_local_stat_tells_absent_file_directory_and_link(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "l").symlink_to(tmp_path / "missing")
    assert LOCAL.stat(tmp_path / "none") is None
    assert LOCAL.stat(tmp_path / "f").kind == "file" and LOCAL.stat(tmp_path / "f").size == 3
    assert LOCAL.stat(tmp_path).kind == "directory"
    assert LOCAL.stat(tmp_path / "l").kind == "symlink"
    assert LOCAL.stat(tmp_path / "l", follow_symlinks=True) is None  # dangling: nothing there, as Path.exists says
