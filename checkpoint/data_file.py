"""A checkpoint data file as it is written: its size and CRC-32 kept on the way, tensors as archives.

:class:`CrcStream` wraps an open file; what goes through it is counted once,
large buffers have their CRC-32 computed on a helper thread while the OS
copies them, and writeback of each large piece is started right away
(``sync_file_range``) so the file's final fsync waits for less.
:func:`write_tensor` appends one tensor as the ``torch.save``-compatible
archive DCP stores per chunk, from the tensor's raw bytes
(:mod:`checkpoint.chunk_archive`). Both writers of data files use these:
DCP's (:class:`checkpoint.storage.FsdpWriter`) and the tensor-major one behind
reshard / import (:mod:`checkpoint.tool.rewrite`).
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from checkpoint.chunk_archive import crc32_combine, plan_archive
from checkpoint.durable import disk_full_is_clear
from checkpoint.manifest import FileRecord

__all__ = ["CrcStream", "tensor_bytes", "write_tensor"]


class CrcStream(io.RawIOBase):
    """A write-only file that keeps the CRC-32 and size of what went through it.

    A large buffer's CRC is computed on a helper thread while the main thread
    hands the same buffer to the OS (both release the GIL), and joined before
    ``write`` returns: the caller may free the buffer right after.
    """

    _OVERLAP_BYTES = 1 << 20
    _pool: ThreadPoolExecutor | None = None
    _writeback: ThreadPoolExecutor | None = None

    def __init__(self, raw: io.RawIOBase | io.BufferedWriter) -> None:
        self.raw = raw
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
            self.crc = zlib.crc32(view, self.crc)
            self._write_all(view)
            self.size += len(view)
        return len(view)

    def write_uncounted(self, b) -> int:
        """Write ``b`` and return its own CRC-32 (folded into the file's, computed while the OS copies it)."""
        view = memoryview(b).cast("B")
        if CrcStream._pool is None:
            CrcStream._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-crc")
        pending = CrcStream._pool.submit(zlib.crc32, view)
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

    @classmethod
    def create(cls, path: str | os.PathLike) -> CrcStream:
        """A new, unbuffered file at ``path`` (writes go straight to the OS; the CRC sees every byte once)."""
        return cls(open(path, "wb", buffering=0))

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
        if not self.closed:
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


def write_tensor(stream: CrcStream, tensor: torch.Tensor) -> None:
    """One tensor as a ``torch.save`` archive; ``torch.save`` itself only where the raw layout does not apply."""
    # DCP's loader moves device tensors to the host and clones views of larger
    # storages (torch.save would write the whole storage); here only the
    # chunk's own bytes are written, so a contiguous view needs no copy.
    # resolve_conj/neg: a conj() / neg view keeps its bit through contiguous(), and its raw
    # bytes are not its values
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    layout = plan_archive(tensor)
    if layout is None:
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        torch.save(tensor, stream)  # type: ignore[arg-type]  # torch's FileLike omits io.RawIOBase; save only writes
        return
    stream.write(layout.head)
    data_crc = stream.write_uncounted(tensor_bytes(tensor))
    stream.write(layout.tail(data_crc))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    # numpy's stubs declare ndarray.__buffer__ for Python >= 3.12 only; the buffer protocol is there on every version
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
