"""The checkpoint library reaches the file system only through its storage interface (checkpoint/storage_backend.py)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import threading
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.errors import CheckpointCorruptError
from checkpoint.storage_backend import (
    LOCAL,
    CrcStream,
    FileRecord,
    FileStat,
    LocalStorage,
    Storage,
    VersionConflict,
    mount,
    storage_for,
    unmount,
)

REPO = Path(__file__).resolve().parents[1]

# The library modules whose file-system use goes through checkpoint.storage_backend.
ROUTED = [
    "atomic",
    "commit",
    "content_check",
    "data_file",
    "dcp_metadata",
    "manifest",
    "object_commit",
    "opener",
    "reader",
    "retention",
    "storage",
]
# The implementations: LocalStorage and its durable small-file replace; FsspecStorage (URLs).
IMPLEMENTATION = ["storage_backend", "durable", "fsspec_storage"]

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


# The fsdp-ckpt tool's modules write foreign formats with their own files; once they live in
# checkpoint/tool/ (not globbed above) this set names nothing and can go.
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


class _MemoryStorage:
    """A second backend: every object and directory in a dict, nothing on disk, no fsync, no flock.

    Objects appear whole when their writer finishes (as on an object store); a directory rename moves every
    name under it. It implements exactly the methods of ``Storage``, nothing more, so a save and a load
    through it show that the library needs no other file-system access.
    """

    renames_atomically = True
    conditional_put = False

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.dirs: set[str] = set()
        self.versions: dict[str, int] = {}
        self._locks: dict[str, threading.Lock] = {}

    def _put(self, path, data: bytes) -> None:
        key = os.path.abspath(path)
        assert os.path.dirname(key) in self.dirs, f"{key}: parent directory missing"
        assert key not in self.dirs, f"{key} is a directory"
        self.objects[key] = data
        self.versions[key] = self.versions.get(key, 0) + 1

    def create(self, path) -> CrcStream:
        storage = self

        class Stream(CrcStream):
            def finish(self) -> FileRecord:  # the object appears whole, now
                self.wait_for_hints()
                storage._put(path, bytes(self.raw.getbuffer()))
                self.close()
                return FileRecord(size=self.size, crc32=self.crc)

        return Stream(io.BytesIO())

    def write_file(self, path, data, *, sync_dir: bool = False) -> None:
        buffer = io.BytesIO()
        if callable(data):
            data(buffer)
        else:
            buffer.write(data.encode() if isinstance(data, str) else data)
        self._put(path, buffer.getvalue())

    def open_read(self, path, *, follow_symlinks: bool = False):
        key = os.path.abspath(path)
        if key in self.dirs:
            raise CheckpointCorruptError(f"{path}: a directory, not a regular file")
        if key not in self.objects:
            raise FileNotFoundError(path)
        return io.BytesIO(self.objects[key])

    def read_into(self, f, buffers, offset: int) -> int:
        f.seek(offset)
        done = 0
        for buffer in buffers:
            got = f.readinto(memoryview(buffer).cast("B"))
            done += got
            if got < len(buffer):
                break
        return done

    def _children(self, key: str) -> list[str]:
        return [name for name in (*self.objects, *self.dirs) if os.path.dirname(name) == key]

    def list(self, directory) -> list[str]:
        key = os.path.abspath(directory)
        if key not in self.dirs:
            raise FileNotFoundError(directory)
        return [os.path.basename(name) for name in self._children(key)]

    def stat(self, path, *, follow_symlinks: bool = False) -> FileStat | None:
        key = os.path.abspath(path)
        if key in self.objects:
            return FileStat("file", len(self.objects[key]), "a regular file")
        return FileStat("directory", 0, "a directory") if key in self.dirs else None

    def version(self, path):
        key = os.path.abspath(path)
        return (key, self.versions[key]) if key in self.objects else None

    def delete(self, path, *, missing_ok: bool = False) -> None:
        if self.objects.pop(os.path.abspath(path), None) is None and not missing_ok:
            raise FileNotFoundError(path)

    def make_dir(self, path) -> None:
        key = os.path.abspath(path)
        while key not in self.dirs and key != os.path.dirname(key):
            assert key not in self.objects, f"{key} is an object"
            self.dirs.add(key)
            key = os.path.dirname(key)

    def remove_dir(self, path) -> None:
        key = os.path.abspath(path)
        assert not self._children(key), f"{key} is not empty"
        self.dirs.discard(key)

    def remove_tree(self, path, *, ignore_errors: bool = False) -> None:
        key = os.path.abspath(path)
        for name in [n for n in (*self.objects, *self.dirs) if n == key or n.startswith(key + os.sep)]:
            self.objects.pop(name, None)
            self.dirs.discard(name)

    def rename(self, src, dst) -> None:
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        assert not self._children(dst), f"rename onto the non-empty {dst}"
        self.dirs.discard(dst)
        for table in (self.objects, self.versions):
            for name in [n for n in table if n == src or n.startswith(src + os.sep)]:
                table[dst + name[len(src) :]] = table.pop(name)  # type: ignore[assignment]
        for name in [n for n in self.dirs if n == src or n.startswith(src + os.sep)]:
            self.dirs.discard(name)
            self.dirs.add(dst + name[len(src) :])

    def sync_dir(self, path) -> None:
        pass

    @contextlib.contextmanager
    def lock(self, path, *, timeout=None):
        with self._locks.setdefault(os.path.abspath(path), threading.Lock()):
            yield

    def put_if(self, path, data: bytes, *, version) -> None:
        if self.version(path) != version:
            raise VersionConflict(path)
        self._put(path, data)


def test_a_checkpoint_saved_replaced_and_committed_by_rank_through_an_in_memory_backend_loads_back(tmp_path):
    backend = _MemoryStorage()
    root = tmp_path / "bucket"
    protocol = [*_protocol_methods(), *Storage.__annotations__]  # methods and the one attribute
    assert sorted(name for name in vars(_MemoryStorage) if not name.startswith("_")) == sorted(protocol)
    mount(root, backend)
    try:
        first = {"w": torch.arange(12.0).reshape(3, 4), "extra": {"step": 1}}
        checkpoint.save_state_dict(first, root / "ck")
        second = {"w": -torch.arange(12.0).reshape(3, 4), "extra": {"step": 2}}
        checkpoint.save_state_dict(second, root / "ck")  # replaces the first: the swap, in memory
        target = {"w": torch.zeros(3, 4), "extra": {"step": None}}
        checkpoint.load_state_dict(target, root / "ck", verify="full")
        assert torch.equal(target["w"], second["w"]) and target["extra"] == {"step": 2}

        full = torch.arange(20.0).reshape(5, 4)
        for rank in range(2):  # scale mode: ranks written apart, then one commit merges their records
            rows = full[3 * rank : 3 * rank + 3]  # rows [0, 3) and [3, 5)
            checkpoint.write_rank(root / "ranks", rank, 2, {"w": checkpoint.shard(rows, (5, 4), offsets=(3 * rank, 0))})
        checkpoint.commit(root / "ranks", 2)
        target = {"w": torch.zeros(5, 4)}
        checkpoint.load_state_dict(target, root / "ranks")
        assert torch.equal(target["w"], full)
    finally:
        unmount(root)
    assert not root.exists()  # nothing reached the local disk
    names = {os.path.relpath(k, root) for k in backend.objects}
    assert {"ck/manifest.json", "ck/.metadata", "ranks/manifest.json"} <= names
    assert not any(".fsdp-ckpt" in name for name in names)  # no staging, swap dir or lock left behind


class _StorageWithoutLockTimeout(_MemoryStorage):
    """A backend written before ``Storage.lock`` took ``timeout``."""

    @contextlib.contextmanager
    def lock(self, path):
        with self._locks.setdefault(os.path.abspath(path), threading.Lock()):
            yield


def test_a_backend_whose_lock_takes_no_timeout_still_saves_and_is_named_once(tmp_path, caplog):
    root = tmp_path / "old-backend"
    mount(root, _StorageWithoutLockTimeout())
    try:
        with caplog.at_level(logging.WARNING, logger="checkpoint.atomic"):
            for step in (1.0, 2.0):
                checkpoint.save_state_dict({"w": torch.full((3,), step)}, root / "ck")
        target = {"w": torch.zeros(3)}
        checkpoint.load_state_dict(target, root / "ck")
        assert torch.equal(target["w"], torch.full((3,), 2.0))
    finally:
        unmount(root)
    said = [r.getMessage() for r in caplog.records if "_StorageWithoutLockTimeout" in r.getMessage()]
    assert len(said) == 1 and "timeout" in said[0] and "lock_timeout" in said[0]


def test_a_save_and_a_load_resolve_the_storage_of_their_path_once(tmp_path, monkeypatch):
    import checkpoint.storage_backend as backend_module

    # The mount table is consulted by a private function; counting its calls is the only way to see that
    # helpers receive the resolved storage instead of looking it up again (STYLE.md habit 14).
    calls = []
    real = backend_module._lookup
    monkeypatch.setattr(backend_module, "_lookup", lambda path: calls.append(path) or real(path))
    checkpoint.save_state_dict({"w": torch.ones(3), "extra": {"step": 1}}, tmp_path / "ck")
    checkpoint.save_state_dict({"w": torch.ones(3), "extra": {"step": 2}}, tmp_path / "ck")  # the swap too
    assert len(calls) == 2, calls
    checkpoint.load_state_dict({"w": torch.zeros(3), "extra": {"step": None}}, tmp_path / "ck")
    assert len(calls) == 3, calls
