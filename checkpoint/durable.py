"""Durable file replacement: write a sibling temp file, fsync it, rename it over the target.

Every small file a checkpoint commits by (``.metadata``, ``manifest.json``, a
rank's ``__<rank>.rank.json``, an exported torch file) goes through here, so a
reader sees either the old file or the whole new one, never a torn write, and
the bytes are on disk before the name points at them. The format library calls
it as :class:`~checkpoint.storage_backend.LocalStorage`'s ``write_file``
(through the storage interface); the tool's own exports call it directly.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["DiskFullError", "disk_full_is_clear", "durable_replace", "durable_write", "fsync_dir", "temp_path"]


class DiskFullError(OSError):
    """The device (or the user's quota) ran out of space while a checkpoint file was written.

    Raised by every writer instead of a bare ``OSError(ENOSPC)``; the writer
    removes its staging, and whatever was at the target before stays as it was.
    """


@contextlib.contextmanager
def disk_full_is_clear(path: str | os.PathLike) -> Iterator[None]:
    """Turn ``ENOSPC`` / ``EDQUOT`` raised inside the block into a :class:`DiskFullError` naming ``path``."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFullError(
            exc.errno,
            f"no space left on the device (or quota exceeded) while writing {str(path)!r}: nothing was "
            "committed and what was at the target is unchanged; free space or write to another file system",
        ) from exc


TEMP_SUFFIX = ".tmp"


def temp_path(path: str | os.PathLike) -> Path:
    """The sibling ``<name>.tmp`` a file is written under before it is renamed to ``path``.

    Same directory as ``path``, so the rename is atomic (never across file systems).
    """
    path = Path(path)
    return path.with_name(path.name + TEMP_SUFFIX)


def durable_write(
    path: str | os.PathLike,
    data: bytes | str | Callable[[BinaryIO], object],
    *,
    sync_dir: bool = False,
) -> None:
    """Replace ``path`` by ``data`` (bytes, UTF-8 text, or a function writing to a binary file).

    Side effects: writes ``temp_path(path)``, fsyncs it, renames it to ``path``
    and, with ``sync_dir``, fsyncs the directory so the rename itself survives a
    crash (pass it where this write is a commit point). If writing fails, the
    temp file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        with disk_full_is_clear(path), open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _rename(tmp, path, sync_dir)


def durable_replace(tmp: str | os.PathLike, path: str | os.PathLike, *, sync_dir: bool = False) -> None:
    """fsync ``tmp``, a file already written by other means (e.g. through a memory map), and rename it to ``path``.

    Precondition: ``tmp`` is in ``path``'s directory and nothing writes to it any more.
    """
    with disk_full_is_clear(path), open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _rename(Path(tmp), Path(path), sync_dir)


def _rename(tmp: Path, path: Path, sync_dir: bool) -> None:
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories can't be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
