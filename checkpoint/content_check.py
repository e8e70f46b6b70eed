"""Content verification streamed with the read: each file's CRC-32, from the bytes the reader reads.

The CRC-32 itself is here too, in one place for the whole library: :func:`crc32`
and :func:`crc32_combine` are ISA-L's (``isal``, a base dependency: ~10x zlib's
speed with carry-less multiply, and a combine in about a microsecond), so a
verified load costs little more than an unverified one. Where ``isal`` cannot be
installed they fall back to zlib's CRC (a load from the page cache is then
CRC-bound) and a pure-Python combine (tens of microseconds a call).

The manifest records the CRC-32 of every file. A reader hands each range it
reads to :meth:`ContentCheck.add` (in any order: pieces are joined with
:func:`crc32_combine`); large pieces are summed on one helper thread (ISA-L's
CRC releases the GIL), overlapping the next read. The hand-over is a queue put
and a :class:`PendingSum`, no ``Future`` and executor bookkeeping per piece: it
sits on the reading thread's critical path right after a read has evicted the
caches, where a ``ThreadPoolExecutor.submit`` took ~50 us of CPU (a 256 MiB load
on a 2-core VM: 3.4-5.4 ms of the reading thread's ~50 ms went to verification, 1.7-3.5 ms now).
:meth:`ContentCheck.finish` reads only the bytes no one asked for (e.g. the
optimizer state beside the weights of a model-only load), joins the pieces and
compares each file touched with its manifest record. No byte is read twice.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from checkpoint.errors import CheckpointCorruptError

if TYPE_CHECKING:  # storage_backend imports the CRC from here: these names are for annotations only
    from checkpoint.storage_backend import FileRecord, Storage

__all__ = ["ContentCheck", "PendingSum", "crc32", "crc32_combine"]

# --- CRC-32 of a concatenation without ISA-L (polynomial arithmetic modulo the CRC-32 polynomial) ---

_POLY = 0xEDB88320  # CRC-32 polynomial, bit-reflected as zlib uses it


def _mult_mod_p(a: int, b: int) -> int:
    """Product of two bit-reflected polynomials modulo the CRC-32 polynomial."""
    top = 1 << 31
    product = 0
    while a:
        if a & top:
            product ^= b
            a ^= top
        top >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers_of_x() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(1, 64):
        table.append(_mult_mod_p(table[-1], table[-1]))  # x^(2^k)
    return table


_X_2K = _powers_of_x()


def _crc32_combine_python(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (what zlib's ``crc32_combine`` does)."""
    shift = 1 << 31  # x^0
    k = 3  # len2 bytes = len2 * 2^3 bits
    n = len2
    while n:
        if n & 1:
            shift = _mult_mod_p(_X_2K[k & 63], shift)
        n >>= 1
        k += 1
    return _mult_mod_p(shift, crc1) ^ crc2


crc32: Callable[..., int]
"""``crc32(data, value=0)``: zlib's CRC-32 (same polynomial and results), ISA-L's implementation when installed"""
crc32_combine: Callable[[int, int, int], int]
"""``crc32_combine(crc1, crc2, len2)``: the CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``"""
try:
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # a platform without isal wheels: correct, but verified loads are CRC-bound
    crc32, crc32_combine = zlib.crc32, _crc32_combine_python

_INLINE_BYTES = 1 << 20
_GAP_READ = 16 << 20


class PendingSum:
    """The CRC-32 of a piece being summed on the helper thread; :meth:`result` waits for it."""

    __slots__ = ("crc", "error", "_summing")

    def __init__(self) -> None:
        self.crc: int | None = None
        self.error: BaseException | None = None
        self._summing = threading.Lock()  # held until summed: a waiter blocks on it (no Condition per piece)
        self._summing.acquire()

    def done(self) -> bool:
        return self.crc is not None or self.error is not None

    def result(self) -> int:
        if not self.done():
            with self._summing:  # released by the helper thread once summed
                pass
        if self.error is not None:
            raise self.error
        assert self.crc is not None
        return self.crc


class _Summer:
    """The one helper thread summing large pieces, in the order they were handed over.

    A daemon thread, stopped (its queue summed first) at interpreter exit; a forked
    child starts its own on first use.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[PendingSum, list[memoryview]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, views: list[memoryview]) -> PendingSum:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-crc-read", daemon=True)
            self._thread.start()
        pending = PendingSum()
        self._queue.put((pending, views))
        return pending

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            pending, views = job
            try:
                pending.crc = _crc_of_run(views)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for this sum
                pending.error = exc
            pending._summing.release()


_summer = _Summer()


def _stop_at_exit() -> None:
    _summer.stop()


atexit.register(_stop_at_exit)
if hasattr(os, "register_at_fork"):  # the child has no helper thread: it starts one of its own on first use

    def _after_fork_in_child() -> None:
        global _summer
        _summer = _Summer()

    os.register_at_fork(after_in_child=_after_fork_in_child)


class ContentCheck:
    """CRC-32 of the files of one checkpoint, as they are read; checked by :meth:`finish`.

    ``files``: the manifest's records, by name relative to ``directory``, which
    ``store`` holds. Not for concurrent readers of one file (pieces from threads
    are fine: a lock guards the bookkeeping).
    """

    def __init__(self, directory: Path, files: dict[str, FileRecord], store: Storage) -> None:
        self.directory = directory
        self.files = files
        self.store = store
        self._pieces: dict[str, dict[int, tuple[int, int | PendingSum]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, offset: int, data) -> PendingSum | None:
        """``data`` (bytes-like) was read from ``name`` at ``offset``.

        Returns the sum still running on a helper thread (a large piece): the
        caller keeps ``data`` alive and unchanged until it is done; ``None``: summed already.
        """
        return self.add_run(name, offset, [data])

    def add_run(self, name: str, offset: int, buffers: list) -> PendingSum | None:
        """``buffers`` (bytes-like) were read one after another from ``name`` at ``offset``: one piece, summed
        as one (a batched read of many small chunks costs one sum and one record, not one per buffer).
        Returns as :meth:`add` does."""
        views = [memoryview(b).cast("B") for b in buffers]
        length = sum(map(len, views))
        if not length:
            return None
        crc = _crc_of_run(views) if length < _INLINE_BYTES else _summer.submit(views)
        with self._lock:
            pieces = self._pieces.setdefault(name, {})
            if offset not in pieces or pieces[offset][0] < length:
                pieces[offset] = (length, crc)
        return crc if isinstance(crc, PendingSum) else None

    def finish(self) -> None:
        """Check every file read from since the last call; raise :class:`CheckpointCorruptError` naming a bad one."""
        with self._lock:
            touched, self._pieces = self._pieces, {}
        for name in sorted(touched):
            self._check_file(name, touched[name])

    def _check_file(self, name: str, pieces: dict[int, tuple[int, int | PendingSum]]) -> None:
        path = self.directory / name
        record = self.files.get(name)
        if record is None:
            raise CheckpointCorruptError(
                f"{path}: read but not listed in the manifest; restore the checkpoint from a copy"
            )
        crc, pos = 0, 0
        with self.store.open_read(path) as f:
            for offset in sorted(pieces):
                length, piece = pieces[offset]
                if offset < pos:
                    continue  # overlaps a piece already counted; the gap read below covers the rest
                if offset > pos:
                    crc = crc32_combine(crc, _crc_of_range(f, pos, offset - pos, path), offset - pos)
                piece_crc = piece.result() if isinstance(piece, PendingSum) else piece
                crc, pos = crc32_combine(crc, piece_crc, length), offset + length
            if pos < record.size:
                crc = crc32_combine(crc, _crc_of_range(f, pos, record.size - pos, path), record.size - pos)
        if pos > record.size or crc != record.crc32:
            raise CheckpointCorruptError(
                f"{path}: CRC-32 does not match the manifest (the file is corrupt); values read from it may be "
                "wrong: restore the file from a copy or re-save the checkpoint, and load again"
            )


def _crc_of_run(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = crc32(view, crc)
    return crc


def _crc_of_range(f, start: int, length: int, path: Path) -> int:
    f.seek(start)
    crc, left = 0, length
    while left:
        chunk = f.read(min(left, _GAP_READ))
        if not chunk:
            raise CheckpointCorruptError(f"{path}: ends {left} bytes early (truncated); restore the file from a copy")
        crc = crc32(chunk, crc)
        left -= len(chunk)
    return crc
