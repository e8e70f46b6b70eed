"""Content verification streamed with the read: each file's CRC-32, from the bytes the reader reads.

The manifest records the CRC-32 of every file. A reader hands each range it
reads to :meth:`ContentCheck.add` (in any order: pieces are joined with
:func:`~checkpoint.chunk_archive.crc32_combine`); large pieces are summed on a
helper thread (the CRC releases the GIL), overlapping the next read. With the
``fast-crc`` extra (ISA-L, ~20 GB/s a core) the sums cost little; with zlib
(~2.5 GB/s) a load from the page cache is CRC-bound.
:meth:`ContentCheck.finish` reads only the bytes no one asked for (e.g. the
optimizer state beside the weights of a model-only load), joins the pieces and
compares each file touched with its manifest record. No byte is read twice.
"""

from __future__ import annotations

import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from checkpoint.chunk_archive import crc32_combine
from checkpoint.errors import CheckpointCorruptError
from checkpoint.storage_backend import FileRecord, storage_for

try:  # ISA-L's CRC-32 (same polynomial as zlib's, ~10x faster: carry-less multiply); optional fast path
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pip install offload-fsdp[fast-crc]; without it verified loads are CRC-bound
    _crc32 = zlib.crc32

__all__ = ["ContentCheck"]

_INLINE_BYTES = 1 << 20
_GAP_READ = 16 << 20


class ContentCheck:
    """CRC-32 of the files of one checkpoint, as they are read; checked by :meth:`finish`.

    ``files``: the manifest's records, by name relative to ``directory``. Not
    for concurrent readers of one file (pieces from threads are fine: a lock
    guards the bookkeeping).
    """

    _pool: ThreadPoolExecutor | None = None

    def __init__(self, directory: Path, files: dict[str, FileRecord]) -> None:
        self.directory = directory
        self.files = files
        self._pieces: dict[str, dict[int, tuple[int, int | Future]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, offset: int, data) -> None:
        """``data`` (bytes-like, kept alive by the caller until :meth:`finish`) was read from ``name`` at ``offset``."""
        view = memoryview(data).cast("B")
        if not len(view):
            return
        crc: int | Future
        if len(view) < _INLINE_BYTES:
            crc = _crc32(view)
        else:
            if ContentCheck._pool is None:
                ContentCheck._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-crc-read")
            crc = ContentCheck._pool.submit(_crc32, view)
        with self._lock:
            pieces = self._pieces.setdefault(name, {})
            if offset not in pieces or pieces[offset][0] < len(view):
                pieces[offset] = (len(view), crc)

    def finish(self) -> None:
        """Check every file read from since the last call; raise :class:`CheckpointCorruptError` naming a bad one."""
        with self._lock:
            touched, self._pieces = self._pieces, {}
        for name in sorted(touched):
            self._check_file(name, touched[name])

    def _check_file(self, name: str, pieces: dict[int, tuple[int, int | Future]]) -> None:
        path = self.directory / name
        record = self.files.get(name)
        if record is None:
            raise CheckpointCorruptError(
                f"{path}: read but not listed in the manifest; restore the checkpoint from a copy"
            )
        crc, pos = 0, 0
        with storage_for(path).open_read(path) as f:
            for offset in sorted(pieces):
                length, piece = pieces[offset]
                if offset < pos:
                    continue  # overlaps a piece already counted; the gap read below covers the rest
                if offset > pos:
                    crc = crc32_combine(crc, _crc_of_range(f, pos, offset - pos, path), offset - pos)
                piece_crc = piece.result() if isinstance(piece, Future) else piece
                crc, pos = crc32_combine(crc, piece_crc, length), offset + length
            if pos < record.size:
                crc = crc32_combine(crc, _crc_of_range(f, pos, record.size - pos, path), record.size - pos)
        if pos > record.size or crc != record.crc32:
            raise CheckpointCorruptError(
                f"{path}: CRC-32 does not match the manifest (the file is corrupt); values read from it may be "
                "wrong: restore the file from a copy or re-save the checkpoint, and load again"
            )


def _crc_of_range(f, start: int, length: int, path: Path) -> int:
    f.seek(start)
    crc, left = 0, length
    while left:
        chunk = f.read(min(left, _GAP_READ))
        if not chunk:
            raise CheckpointCorruptError(f"{path}: ends {left} bytes early (truncated); restore the file from a copy")
        crc = _crc32(chunk, crc)
        left -= len(chunk)
    return crc
