"""A checkpoint data file as it is written: its size and CRC-32 kept on the way, tensors as archives.

:class:`~checkpoint.storage_backend.CrcStream` (the storage's write stream)
counts what goes through it once, computing large buffers' CRC-32 on a helper
thread while the OS copies them. :func:`write_tensor` appends one tensor as the ``torch.save``-compatible
archive DCP stores per chunk, from the tensor's raw bytes
(:mod:`checkpoint.chunk_archive`). :class:`DataFile` is the one way a data
file is written: DCP's writer (:class:`checkpoint.storage.FsdpWriter`) and the
tensor-major one behind reshard / import (:mod:`checkpoint.tool.rewrite`) both
append through it, each item returning the :data:`StorageInfo` that
``.metadata`` records for it (:mod:`checkpoint.dcp_metadata`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable

import torch

# _StorageInfo: the (file, offset, length) DCP's FileSystemReader expects per stored item in
# Metadata.storage_data; no public name. Renamed in torch -> this import fails, and no writer can
# record where an item is stored in a way plain DCP reads.
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo

from checkpoint.chunk_archive import plan_archive
from checkpoint.content_check import crc32
from checkpoint.storage_backend import CrcStream, FileRecord, locate, storage_for

__all__ = ["BatchedStream", "CrcStream", "DataFile", "StorageInfo", "data_file_name", "tensor_bytes", "write_tensor"]

StorageInfo = _StorageInfo
"""Where one stored item is: ``StorageInfo(relative_path, offset, length)``."""


def data_file_name(prefix: str) -> str:
    """A rank's one data file, named as DCP's ``FileSystemWriter`` names it: ``__<rank>_`` -> ``__<rank>_0.distcp``."""
    return f"{prefix}0{DEFAULT_SUFFIX}"


class BatchedStream(io.RawIOBase):
    """Small writes gathered into one buffer before they reach a :class:`CrcStream`.

    Thousands of small tensors would otherwise cost a system call per piece
    (archive head, data, tail) and, for the data, a helper-thread CRC job plus a
    writeback hint each. Here a small piece is copied into the buffer (its CRC-32,
    when asked for, computed inline) and the buffer goes out as one write of
    at least :attr:`BATCH_BYTES`; a large piece goes straight through, after
    what is buffered. Once a piece is copied the caller may reuse its memory.
    """

    BATCH_BYTES = 1 << 20

    def __init__(self, stream: CrcStream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if len(view) >= self.BATCH_BYTES:
            self.flush_batch()
            self.stream.write(view)
        else:
            self._buffer += view
            if len(self._buffer) >= self.BATCH_BYTES:
                self.flush_batch()
        return len(view)

    def write_uncounted(self, b) -> int:
        """Write ``b`` and return its own CRC-32 (as :meth:`CrcStream.write_uncounted`)."""
        view = memoryview(b).cast("B")
        if len(view) >= self.BATCH_BYTES:
            self.flush_batch()
            return self.stream.write_uncounted(view)
        self.write(view)
        return crc32(view)

    def tell(self) -> int:
        return self.stream.tell() + len(self._buffer)

    def flush_batch(self) -> None:
        if self._buffer:
            self.stream.write(self._buffer)
            self._buffer = bytearray()


class DataFile:
    """One data file being written in DCP's layout: values appended one after another, each where it landed.

    Tensors go in as ``torch.save``-compatible archives (:func:`write_tensor`),
    non-tensor values as the bytes given; small pieces are batched
    (:class:`BatchedStream`), size and CRC-32 kept on the way
    (:class:`CrcStream`). :meth:`finish` makes the file durable.
    """

    def __init__(self, directory: str | os.PathLike, name: str) -> None:
        self.name = name
        path = locate(directory) / name
        self.stream = storage_for(path).create(path)
        self.out = BatchedStream(self.stream)

    def add_tensor(
        self, tensor: torch.Tensor, write: Callable[[BatchedStream, torch.Tensor], None] | None = None
    ) -> StorageInfo:
        """Append ``tensor`` as a chunk archive (``write``: :func:`write_tensor` unless given)."""
        start = self.out.tell()
        (write or write_tensor)(self.out, tensor)
        return StorageInfo(self.name, start, self.out.tell() - start)

    def add_bytes(self, data) -> StorageInfo:
        start = self.out.tell()
        self.out.write(data)
        return StorageInfo(self.name, start, self.out.tell() - start)

    def finish(self) -> FileRecord:
        """fsync and close; the file's size and CRC-32. Closes the file even when the fsync fails."""
        try:
            self.out.flush_batch()
        except BaseException:
            self.stream.abort()
            raise
        return self.stream.finish()

    def abort(self) -> None:
        """Close without the fsync (the file is being given up)."""
        self.stream.abort()


def write_tensor(stream: BatchedStream | CrcStream, tensor: torch.Tensor) -> None:
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
