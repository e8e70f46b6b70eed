"""Where checkpoint bytes live: the storage interface the format library writes and reads through.

Every filesystem call of the format library (the modules ``atomic``,
``commit``, ``content_check``, ``data_file``, ``dcp_metadata``, ``manifest``,
``opener``, ``reader``, ``storage``) goes through a :class:`Storage`, found by
:func:`storage_for`; :class:`LocalStorage` (a POSIX file system) is the one
implementation, with :mod:`checkpoint.durable` (temp file, fsync, rename) as
its small-file replace. ``tests/test_storage_backend.py`` checks that no other
library module calls the file system itself. A second backend (an object
store, another file system) is one new class implementing :class:`Storage`,
made the storage of a directory tree with :func:`mount`. The commit protocol
in terms of these operations is in ``docs/checkpoint_format.md``
("Storage and the commit protocol").

What the format needs from a storage, whatever it is:

* objects are written whole and sequentially (:meth:`Storage.create`: a
  :class:`CrcStream` that keeps the size and CRC-32 of what went through it,
  durable once ``finish`` returns), or replaced whole (:meth:`Storage.write_file`);
* reads take ranges of one object (:meth:`Storage.open_read`,
  :meth:`Storage.read_into`) and open only plain objects: never a link, FIFO
  or device that could block or point outside the checkpoint;
* a listing, a stat, a delete, and :meth:`Storage.version`, which changes
  when an object is replaced (a reader detects a save swapping in meanwhile);
* the commit primitives: a staging area made and removed as a whole
  (:meth:`~Storage.make_dir`, :meth:`~Storage.remove_dir`,
  :meth:`~Storage.remove_tree`), the swap into place (:meth:`~Storage.rename`
  made durable by :meth:`~Storage.sync_dir`), and a per-path writer lock
  (:meth:`~Storage.lock`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import logging
import os
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, cast

from checkpoint.content_check import crc32, crc32_combine
from checkpoint.durable import disk_full_is_clear, durable_write, fsync_dir
from checkpoint.errors import CheckpointCorruptError

__all__ = [
    "LOCAL",
    "CrcStream",
    "FileRecord",
    "FileStat",
    "LocalStorage",
    "SharedFileSystemStorage",
    "Storage",
    "VersionConflict",
    "locate",
    "mount",
    "storage_for",
    "unmount",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileRecord:
    """One stored file's size and CRC-32, as written (and as ``manifest.json`` records them)."""

    size: int
    """bytes"""
    crc32: int
    """CRC-32 of the whole file (zlib's polynomial: ``zlib.crc32`` gives the same)"""


@dataclass(frozen=True)
class FileStat:
    """What a stat of one name says (without following a link unless asked)."""

    kind: Literal["file", "directory", "symlink", "other"]
    size: int
    description: str
    """how an error names the kind: "a regular file", "a directory", "a symbolic link", "a FIFO", ..."""
    link_target: str | None = None
    """for a symbolic link: what it points to, as written, and (``real_path``) where that resolves"""
    real_path: str | None = None
    modified: float | None = None
    """when the object was last written (seconds since the epoch), where the storage says"""


class Storage(Protocol):
    """The operations the format library performs on stored checkpoints; paths name objects and directories."""

    renames_atomically: bool
    """``True``: directory renames are atomic and :meth:`lock` orders writers (a local POSIX file system),
    so a save is staged and renamed into place (:mod:`checkpoint.atomic`); ``False`` (an object store, a
    shared file system without trustworthy ``flock`` / rename): the object-store protocol
    (:mod:`checkpoint.object_commit`), which needs only whole-object writes and :meth:`put_if`."""

    conditional_put: bool
    """``True``: :meth:`put_if` is one atomic step (S3's conditional PUT); ``False`` (or absent): it checks the
    version, then writes, so the object-store protocol makes committers take turns through an object
    :meth:`put_if` creates only if absent (atomic on a file system: an exclusive ``link``)."""

    def create(self, path: str | os.PathLike) -> CrcStream:
        """A new object at ``path`` (replacing any), written sequentially; its ``finish`` makes it durable."""
        ...

    def write_file(
        self, path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], object], *, sync_dir: bool = False
    ) -> None:
        """Replace ``path`` whole (old bytes or new, never torn), durably; ``sync_dir``: a commit point."""
        ...

    def open_read(self, path: str | os.PathLike, *, follow_symlinks: bool = False) -> BinaryIO:
        """Open a plain object for reading; refuse (``CheckpointCorruptError``) anything else."""
        ...

    def read_into(self, f: BinaryIO, buffers: list, offset: int) -> int:
        """Fill ``buffers`` in order from ``offset`` of an open object; the bytes read (short at its end)."""
        ...

    def list(self, directory: str | os.PathLike) -> list[str]:
        """The names directly inside ``directory``."""
        ...

    def stat(self, path: str | os.PathLike, *, follow_symlinks: bool = False) -> FileStat | None:
        """What is at ``path``, or ``None`` when nothing is."""
        ...

    def version(self, path: str | os.PathLike) -> Hashable | None:
        """A token that changes when the object at ``path`` is replaced; ``None`` when absent."""
        ...

    def delete(self, path: str | os.PathLike, *, missing_ok: bool = False) -> None: ...

    def make_dir(self, path: str | os.PathLike) -> None:
        """Make ``path`` and its parents (no error if it is a directory already)."""
        ...

    def remove_dir(self, path: str | os.PathLike) -> None:
        """Remove the empty directory ``path``."""
        ...

    def remove_tree(self, path: str | os.PathLike, *, ignore_errors: bool = False) -> None: ...

    def rename(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        """Atomically move ``src`` (object or directory) to ``dst``, replacing ``dst`` when it may be."""
        ...

    def sync_dir(self, path: str | os.PathLike) -> None:
        """Make the renames inside ``path`` durable."""
        ...

    def lock(self, path: str | os.PathLike, *, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold the lock object ``path`` against other processes (created if needed, removed on release).

        ``timeout``: seconds to wait for another holder, then ``TimeoutError`` naming ``path`` (and the
        holder, where recorded); ``None`` waits as long as it takes."""
        ...

    def put_if(self, path: str | os.PathLike, data: bytes, *, version: Hashable | None) -> None:
        """Write the small object ``path`` whole, only if its :meth:`version` is still ``version``
        (``None``: only if absent); raise :class:`VersionConflict` otherwise, writing nothing."""
        ...


class VersionConflict(FileExistsError):
    """:meth:`Storage.put_if` found another version of the object than the one it was told to replace."""


class CrcStream(io.RawIOBase):
    """A write-only stream over ``raw`` that keeps the CRC-32 and size of what went through it.

    A large buffer's CRC is computed on a helper thread while the main thread
    hands the same buffer to the OS (both release the GIL), and joined before
    ``write`` returns: the caller may free the buffer right after. Over a local
    file it also starts writeback of large pieces (``sync_file_range``) and its
    :meth:`finish` fsyncs; a backend whose objects become durable otherwise
    (e.g. an upload completed on ``finish``) returns a subclass overriding
    :meth:`finish` from its :meth:`Storage.create`.
    """

    _OVERLAP_BYTES = 1 << 20
    _pool: ThreadPoolExecutor | None = None
    _writeback: ThreadPoolExecutor | None = None

    def __init__(self, raw: io.RawIOBase | io.BufferedWriter, *, owns_raw: bool = True) -> None:
        self.raw = raw
        self.owns_raw = owns_raw
        """close ``raw`` with this stream (``False``: the caller opened it and closes it)"""
        self.crc = 0
        self.size = 0
        self._hints: list = []  # pending writeback hints; they use the file, so they end before it closes

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if len(view) >= self._OVERLAP_BYTES:
            self.write_uncounted(view)
        else:
            self.crc = crc32(view, self.crc)
            self._write_all(view)
            self.size += len(view)
        return len(view)

    def write_uncounted(self, b) -> int:
        """Write ``b`` and return its own CRC-32 (folded into the file's, computed while the OS copies it)."""
        view = memoryview(b).cast("B")
        if CrcStream._pool is None:
            CrcStream._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-crc")
        pending = CrcStream._pool.submit(crc32, view)
        start = self.size
        self._write_all(view)
        # Let the disk start on these pages now, so the file's final fsync waits for less. On its own
        # thread: under a congested disk the hint itself can block, and the next write need not wait for it.
        if CrcStream._writeback is None:
            CrcStream._writeback = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writeback")
        if view:  # a length of 0 would mean "to the end of the file"
            self._hints.append(CrcStream._writeback.submit(_start_writeback, self.raw, start, len(view)))
        piece_crc = pending.result()
        self.crc = crc32_combine(self.crc, piece_crc, len(view))
        self.size += len(view)
        return piece_crc

    def finish(self) -> FileRecord:
        """fsync the file and close it; its size and CRC-32. Closes the file even when the fsync fails."""
        try:
            with disk_full_is_clear(
                getattr(self.raw, "name", "a checkpoint file")
            ):  # a file system may report the lack of space only here
                os.fsync(self.raw.fileno())
        finally:
            self.abort()
        return FileRecord(size=self.size, crc32=self.crc)

    def abort(self) -> None:
        """Close without the fsync (the file is being given up)."""
        self.wait_for_hints()  # the hints use the file: they end before it closes
        self.close()

    def wait_for_hints(self) -> None:
        for hint in self._hints:
            hint.result()
        self._hints.clear()

    def _write_all(self, view: memoryview) -> None:
        done = 0
        with disk_full_is_clear(getattr(self.raw, "name", "a checkpoint file")):
            while done < len(view):  # an unbuffered file may take less than asked
                done += self.raw.write(view[done:])

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed and self.owns_raw:
            self.raw.close()
        super().close()


_sync_file_range: Callable[..., int] | Literal[False] | None = None  # resolved on first use; False where unavailable


def _start_writeback(raw, offset: int, length: int) -> None:
    """Start (not wait for) writeback of a just-written range: Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``.

    Only a hint for speed; durability still comes from the fsync that ends every file.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                _sync_file_range = fn
            except (OSError, AttributeError):
                pass
    if _sync_file_range:
        try:
            _sync_file_range(raw.fileno(), offset, length, 2)  # 2 = SYNC_FILE_RANGE_WRITE
        except (OSError, io.UnsupportedOperation):
            pass


class LocalStorage:
    """:class:`Storage` on the local (POSIX) file system."""

    renames_atomically = True
    conditional_put = False

    def create(self, path: str | os.PathLike) -> CrcStream:
        # unbuffered: writes go straight to the OS, and the CRC sees every byte once
        return CrcStream(open(path, "wb", buffering=0))

    def write_file(
        self, path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], object], *, sync_dir: bool = False
    ) -> None:
        durable_write(path, data, sync_dir=sync_dir)

    def open_read(self, path: str | os.PathLike, *, follow_symlinks: bool = False) -> BinaryIO:
        """Open ``path`` for reading, only if it is a regular file (never a FIFO, device or symlink).

        ``lstat`` first, then ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO swapped in between
        cannot block the open) and ``fstat`` on what was opened. ``follow_symlinks``
        accepts a link to a regular file (import sources: the Hugging Face cache is
        a farm of links). Raises ``FileNotFoundError`` or
        :class:`CheckpointCorruptError` naming the path.
        """
        st = os.stat(path) if follow_symlinks else os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(
                f"{path}: {_kind(st.st_mode)}, not a regular file; nothing was read from it: "
                "checkpoints and import sources hold only regular files, put the real file there"
            )
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        if not follow_symlinks:
            flags |= getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise CheckpointCorruptError(
                f"{path}: cannot be opened as a regular file ({_short(exc)}); put the real file there"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointCorruptError(f"{path}: not a regular file; put the real file there")
        return os.fdopen(fd, "rb", buffering=0)

    def read_into(self, f: BinaryIO, buffers: list, offset: int) -> int:
        if hasattr(os, "preadv"):  # one system call for head, data and tail
            return os.preadv(f.fileno(), buffers, offset)
        f.seek(offset)
        done = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            got = f.readinto(view) or 0  # type: ignore[attr-defined]  # BinaryIO omits readinto; files have it
            done += got
            if got < len(view):
                break
        return done

    def list(self, directory: str | os.PathLike) -> list[str]:
        return os.listdir(directory)

    def stat(self, path: str | os.PathLike, *, follow_symlinks: bool = False) -> FileStat | None:
        try:
            st = os.stat(path) if follow_symlinks else os.lstat(path)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            return FileStat("symlink", 0, _kind(mode), os.readlink(Path(path)), os.path.realpath(path))
        kind: Literal["file", "directory", "other"] = (
            "file" if stat.S_ISREG(mode) else "directory" if stat.S_ISDIR(mode) else "other"
        )
        return FileStat(kind, st.st_size, _kind(mode), modified=st.st_mtime)

    def version(self, path: str | os.PathLike) -> Hashable | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def delete(self, path: str | os.PathLike, *, missing_ok: bool = False) -> None:
        Path(path).unlink(missing_ok=missing_ok)

    def make_dir(self, path: str | os.PathLike) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def remove_dir(self, path: str | os.PathLike) -> None:
        os.rmdir(path)

    def remove_tree(self, path: str | os.PathLike, *, ignore_errors: bool = False) -> None:
        shutil.rmtree(path, ignore_errors=ignore_errors)

    def rename(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        os.replace(src, dst)

    def sync_dir(self, path: str | os.PathLike) -> None:
        fsync_dir(path)

    @contextlib.contextmanager
    def lock(self, path: str | os.PathLike, *, timeout: float | None = None) -> Iterator[None]:
        """``fcntl.flock`` on the file ``path`` (on file systems where ``flock`` is not shared between
        hosts, only processes of one host are ordered). The holder writes its pid and host into the file
        (what a waiter that gives up names). The file is removed on release; a waiter that then holds a
        removed file locks the new one instead."""
        fd = _flock(Path(path), timeout)
        try:
            yield
        finally:
            # Removed while still locked: a process waiting on this file finds it gone and locks a new one.
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)  # releases the flock

    def put_if(self, path: str | os.PathLike, data: bytes, *, version: Hashable | None) -> None:
        """An absent ``path`` is created exclusively (``link``, atomic on NFS too); replacing one is a check of
        its version, then the durable rename: two steps, so on a local path two writers are ordered by
        :meth:`lock`, and on a shared file system (:class:`SharedFileSystemStorage`) only best effort."""
        path = Path(path)
        if version is None:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.new")
            durable_write(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise VersionConflict(f"{str(path)!r} was written by another save meanwhile") from None
            finally:
                os.unlink(tmp)
            fsync_dir(path.parent)
            return
        if self.version(path) != version:
            raise VersionConflict(f"{str(path)!r} was replaced by another save meanwhile")
        durable_write(path, data, sync_dir=True)


class SharedFileSystemStorage(LocalStorage):
    """A shared file system (NFS and the like) where ``flock`` or directory renames cannot be trusted.

    Mount it on the directory that holds checkpoints (``checkpoint.mount("/nfs/ckpt", SharedFileSystemStorage())``):
    saves there use the object-store protocol (:mod:`checkpoint.object_commit`: data under a unique save
    id, a commit record written last, no directory rename, no lock), the same as on ``s3://``.
    """

    renames_atomically = False


def _flock(lock: Path, timeout: float | None = None) -> int:
    """An fd holding ``flock`` on ``lock``, the file now at that name (not one a previous holder removed),
    with this process's pid and host written in it. ``TimeoutError`` after ``timeout`` seconds of waiting."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause, warned = 0.01, False
    while True:
        fd = _open_lock_file(lock)
        try:
            if _try_flock(fd):
                if _still_at(lock, fd):
                    _record_holder(fd)
                    return fd
            else:
                if not warned:
                    logger.warning("waiting for another process's save (%s is locked by %s)", lock, _holder(fd))
                    warned = True
                if deadline is not None and time.monotonic() >= deadline:
                    raise _lock_timeout(lock, timeout, _holder(fd))
                # Polled, not a blocking flock: a blocking one cannot be given up at a deadline.
                time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
                pause = min(pause * 2, 0.5)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # locked by another, or the holder we waited for removed this file: try the name again


def _open_lock_file(lock: Path) -> int:
    try:
        # O_NOFOLLOW: a link at the lock name would make the save create or lock a file wherever it points
        return os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        kinds = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}
        if exc.errno not in kinds:
            raise
        raise FileExistsError(
            f"{str(lock)!r} is {kinds[exc.errno]}, in the way of this save's lock file (not made by a save, "
            "left alone); move it away"
        ) from None


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True


def _still_at(lock: Path, fd: int) -> bool:
    """Whether the locked file is still the one at ``lock`` (a holder removes it on release)."""
    try:
        return os.stat(lock).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _record_holder(fd: int) -> None:
    with contextlib.suppress(OSError):  # only what an error message says; the lock is held without it
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)


def _holder(fd: int) -> str:
    """Who holds the lock file open as ``fd``, as its holder recorded it."""
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text if text.startswith("pid ") else "a process that recorded no pid (an older version)"


def _lock_timeout(lock: Path, timeout: float | None, holder: str) -> TimeoutError:
    return TimeoutError(
        f"gave up after {timeout:.1f} s waiting for the lock file {str(lock)!r}, held by {holder}; let that "
        "process finish (or stop it), or wait longer (lock_timeout=..., None waits as long as it takes)"
    )


_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)  # what Path.exists() reads as "not there"


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return word
    return "a special file"


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


LOCAL = LocalStorage()
"""The local file system: the storage of every path no :func:`mount` claims."""

_mounts: dict[str, Storage] = {}  # absolute directory -> the storage of everything under it


def mount(root: str | os.PathLike, storage: Storage) -> None:
    """Make ``storage`` hold every path under the directory ``root`` (a save's staging, swap and lock
    names sit beside its path: mount the directory that holds checkpoints, not one checkpoint)."""
    _mounts[os.path.abspath(root)] = storage


def unmount(root: str | os.PathLike) -> None:
    _mounts.pop(os.path.abspath(root), None)


def locate(path: str | os.PathLike, storage_options: dict | None = None) -> Path:
    """``path`` resolved once, at an entry point, into a path bound to its storage: a URL (``s3://bucket/prefix``,
    any fsspec URL) to its :mod:`checkpoint.fsspec_storage` storage, a local path (a ``Path`` still) to the
    :func:`mount` above it or :data:`LOCAL`. Every helper then reads the storage from the path
    (:func:`storage_for`) instead of resolving it again; joins, ``parent`` and siblings keep it.

    Raises ``ValueError`` for an unsupported URL scheme or a URL mangled by ``pathlib`` (``s3:/bucket``),
    ``ImportError`` naming the extra to install (``pip install offload-fsdp[s3]``) when its package is missing.
    """
    if getattr(path, "storage", None) is not None:
        return path  # type: ignore[return-value]  # already bound
    text = os.fspath(path)
    if "://" in text or _looks_like_mangled_url(text):
        from checkpoint.fsspec_storage import url_path  # fsspec is an optional extra: imported only for URLs

        # Typed as a Path: the library uses only pure path operations (joins, name, parent) on paths, and
        # reaches what they name through storage_for (tests/test_storage_backend.py checks it).
        return cast(Path, url_path(text, storage_options))
    if storage_options:
        raise ValueError(f"storage_options apply to URLs (s3://...), not to the local path {text!r}")
    local = Path(path)
    return _bound_type(_lookup(local))(local)


_bound_types: dict[int, type] = {}  # id(storage) -> its Path subclass (storages live as long as the process)


def _bound_type(storage: Storage) -> type[Path]:
    """A ``Path`` subclass whose instances (and their joins, parents, siblings) carry ``storage``."""
    cls = _bound_types.get(id(storage))
    if cls is None:
        base = type(Path())
        cls = _bound_types[id(storage)] = type(
            f"{type(storage).__name__}Path", (base,), {"storage": storage, "__reduce__": _reduce_to_path}
        )
    return cls


def _reduce_to_path(self: Path) -> tuple:
    return Path, (str(self),)  # pickled as a plain path: the storage is found again where it is used


def _looks_like_mangled_url(text: str) -> bool:
    """``Path("s3://b/x")`` is ``s3:/b/x``: a URL that pathlib took for a local directory named ``s3:``."""
    head = text.split("/", 1)[0]
    return head.endswith(":") and head[:-1].lower() in _URL_SCHEMES


_URL_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "memory", "file", "http", "https"}


def storage_for(path: str | os.PathLike) -> Storage:
    """The storage that holds ``path``: the one a URL path was bound to by :func:`locate`, else the innermost
    :func:`mount` above it, else :data:`LOCAL`."""
    bound = getattr(path, "storage", None)
    if bound is not None:
        return bound  # resolved once, by locate() at the entry point
    if isinstance(path, str) and "://" in path:
        return storage_for(locate(path))
    return _lookup(path)


def _lookup(path: str | os.PathLike) -> Storage:
    if not _mounts:
        return LOCAL
    path = os.path.abspath(path)
    best, found = "", None
    for root, storage in _mounts.items():
        if (path == root or path.startswith(root.rstrip(os.sep) + os.sep)) and len(root) > len(best):
            best, found = root, storage
    return found if found is not None else LOCAL
