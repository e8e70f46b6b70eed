"""DCP storage reader that reads tensor bytes straight into the destination.

DCP's ``FileSystemReader`` runs ``torch.load`` on every stored chunk (one
copy into a new tensor) and then copies the needed part into the destination
(a second copy), even when only a few rows are needed. Chunks written by
:class:`checkpoint.storage.FsdpWriter` are ``torch.save`` archives (so plain
DCP reads them) holding one contiguous tensor of exactly the chunk's shape,
so this reader locates the tensor's bytes inside the archive (zip: stored, not
compressed) and ``readinto``\\ s just the needed byte range, into the
destination when it is contiguous. A whole chunk whose archive is byte for
byte what :mod:`checkpoint.chunk_archive` writes is read in one sequential
``preadv`` (head, data into the destination, tail) with no zip parsing first.
Anything else (another writer's archive, zip64, a transform) goes through
DCP's own path.

Bytes that cannot land in their destination directly (another dtype, part of
a chunk, an archive parsed whole) are read into host buffers of the reader's
own; a :class:`ReadBudget` caps how many such bytes are held at once (a
buffer stays held until its streamed CRC-32 is summed), so a load's extra
host memory is bounded by ``max_read_bytes`` plus one item larger than it.
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import struct
from collections import deque
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from checkpoint.chunk_archive import ArchiveLayout, stored_layout
from checkpoint.content_check import ContentCheck, PendingSum
from checkpoint.data_file import StorageInfo
from checkpoint.errors import CheckpointCorruptError
from checkpoint.load_index import IndexedKeys
from checkpoint.pickle_budget import value_problem
from checkpoint.storage_backend import locate, storage_for

__all__ = ["DEFAULT_MAX_READ_BYTES", "DirectReader", "ReadBudget"]

DEFAULT_MAX_READ_BYTES = 256 << 20
"""The default cap on the host bytes a load holds in its own read buffers at once"""
_SLICE_BYTES = 8 << 20
"""A whole chunk is read in slices of this size: each one's CRC-32 is summed while the next is read, so a
verified load waits only for the last slice's sum"""

_BATCH_CHUNKS = 340
"""Whole chunks per batched read: head, data and tail are 3 buffers each, and one ``preadv`` takes at most 1,024"""

_UNKNOWN = object()
"""Not looked up yet (a layout may be ``None``: not our archive)"""

_EOCD = struct.Struct("<4s4H2LH")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")
_NO_VALUE = 0xFFFFFFFF


class ReadBudget:
    """The host bytes a reader holds in buffers of its own at once, at most ``cap`` (``None``: no cap).

    A buffer is held from :meth:`hold` (before it is allocated) until the reader
    is :meth:`done` with it and its CRC-32, summed on a helper thread, has
    finished. :meth:`hold` first waits for earlier buffers' sums until the new
    one fits; one buffer larger than ``cap`` is held alone. ``peak``: the most held at once.
    """

    def __init__(self, cap: int | None) -> None:
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
            raise ValueError(f"max_read_bytes must be a positive number of bytes or None (no cap), got {cap!r}")
        self.cap = cap
        self.held = 0
        self.peak = 0
        self._summing: deque[tuple[int, PendingSum]] = deque()

    def hold(self, nbytes: int) -> None:
        while self._summing and (
            self._summing[0][1].done() or (self.cap is not None and self.held + nbytes > self.cap)
        ):
            held, summing = self._summing.popleft()
            summing.result()
            self.held -= held
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def done(self, nbytes: int, summing: list[PendingSum]) -> None:
        """The reader no longer needs the buffer; it is free once ``summing`` (its CRC-32 sums) finished."""
        pending = [f for f in summing if not f.done()]
        if not pending:
            self.held -= nbytes
            return
        for f in pending[:-1]:
            self._summing.append((0, f))
        self._summing.append((nbytes, pending[-1]))


class DirectReader(FileSystemReader):
    """Reads a checkpoint whose metadata was already read (and checked) by the caller.

    ``direct=False`` keeps DCP's reading path (for directories written by other tools;
    it reads one item at a time). ``check`` receives every byte range read, for the streamed CRC-32 check
    (the caller calls its ``finish``). Every file is checked to be a regular
    file before it is opened (never a FIFO or device that would block).
    ``max_read_bytes``: the cap of :attr:`budget`, on the bytes held in the reader's own buffers.
    ``index``: where the manifest's load index says each key lies (:mod:`checkpoint.load_index`), for
    :meth:`read_whole_tensors`; ``metadata`` may then be ``None``, the plan's given to
    :meth:`set_up_storage_reader` (DCP's reading protocol) for the rest.
    """

    def __init__(
        self,
        path: str | Path,
        metadata: Metadata | None,
        *,
        direct: bool = True,
        check: ContentCheck | None = None,
        max_read_bytes: int | None = DEFAULT_MAX_READ_BYTES,
        index: IndexedKeys | None = None,
    ) -> None:
        super().__init__(path)
        self.path = locate(path)  # DCP's init made a local Path of it; a URL's stays bound to its storage
        self._metadata = metadata
        self._index = index
        self._direct = direct
        self._check = check
        self.budget = ReadBudget(max_read_bytes)
        self._layouts: dict = {}  # (dtype, chunk shape, stored length) -> ArchiveLayout | None
        self._store = storage_for(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._planned

    @property
    def _planned(self) -> Metadata:
        assert self._metadata is not None, "a reader made from a load index has the metadata of its plan only"
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata  # the plan's (from a load index: its keys' alone)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path in per_file:
            # a FIFO / device / link: a clear error, no hang
            self._store.open_read(locate(self.path) / relative_path).close()
        if not self._direct:
            if not isinstance(self.path, Path):  # a URL: DCP's reader would open a local path of that name
                raise ValueError(
                    f"{self.path}: a plain DCP directory (no manifest.json) is read by DCP's own reader, from "
                    "local paths only; copy it to a local directory, or re-save it with checkpoint.save"
                )
            return super().read_data(plan, planner)
        for relative_path, items in per_file.items():
            path = locate(self.path) / relative_path
            items.sort(key=lambda it: self.storage_data[it.storage_index].offset)
            with self._store.open_read(path) as f:
                self._plan_reads(f, items)
                self._read_file(f, path, items, planner)
        future: TorchFuture = TorchFuture()
        future.set_result(None)
        return future

    def _read_file(self, f, path: Path, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Every item of one file: whole chunks of our layout first (:meth:`_read_wholes`), then the rest
        in file order."""
        wholes: list[_WholeChunk] = []
        others: list[ReadItem] = []
        for item in items:
            info: StorageInfo = self.storage_data[item.storage_index]
            whole = None if item.type == LoadItemType.BYTE_IO else self._whole_chunk(info, item, planner)
            if whole is None:
                others.append(item)
            else:
                wholes.append(whole)
        failed = self._read_wholes(f, wholes)
        for whole in wholes:
            assert whole.item is not None  # made from a plan's item by _whole_chunk
            if whole not in failed:
                planner.commit_tensor(whole.item, whole.target)
            else:  # not our archive after all: the general path reads it (or says what is wrong)
                self._read_tensor(f, path, whole.info, _tensor_bytes(f, whole.info), whole.item, planner)
        tensor_locations: dict[int, tuple[int, int] | None] = {}
        for item in others:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                self.budget.hold(info.length)
                f.seek(info.offset)
                data = _read_exact(f, info.length, path)
                summing = self._verified(info.relative_path, info.offset, data)
                planner.load_bytes(item, io.BytesIO(data))
                self.budget.done(info.length, summing)
                continue
            if info.offset not in tensor_locations:
                tensor_locations[info.offset] = None if info.transform_descriptors else _tensor_bytes(f, info)
            self._read_tensor(f, path, info, tensor_locations[info.offset], item, planner)

    def read_whole_tensors(self, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Read each of ``targets`` (key -> a plain tensor) that is one whole stored chunk of our archive
        layout straight into it, file by file, without a DCP read plan (its ``ReadItem`` s and planner
        lookups cost more than the read of a small tensor); returns the targets left for the planner's path
        (:meth:`read_data`): anything else, and a chunk found not to be ours once read, which that path reads
        again and reports if it is damaged."""
        rest: dict[str, torch.Tensor] = {}
        per_file: dict[str, list[_WholeChunk]] = {}
        for key, target in targets.items():
            whole = self._stored_whole(key, target) if self._direct else None
            if whole is None:
                rest[key] = target
            else:
                per_file.setdefault(whole.info.relative_path, []).append(whole)
        for relative_path, wholes in per_file.items():
            wholes.sort(key=lambda w: w.info.offset)
            with self._store.open_read(locate(self.path) / relative_path) as f:
                plan_reads = getattr(f, "plan_reads", None)
                if plan_reads is not None:  # an object store's file: see _plan_reads
                    plan_reads(sorted({(w.info.offset, w.info.length) for w in wholes}), self.budget)
                for whole in self._read_wholes(f, wholes):
                    rest[whole.key] = targets[whole.key]
        return rest

    def _read_wholes(self, f, wholes: list[_WholeChunk]) -> list[_WholeChunk]:
        """Whole chunks of one file (in file order) into their destinations, runs of small ones next to
        each other in one read; returns those that are not what our writer makes (nothing committed)."""
        failed: list[_WholeChunk] = []
        batch: list[_WholeChunk] = []
        # A file that fetches ahead (an object store's) serves each planned range from blocks held within
        # max_read_bytes; one read spanning several would be fetched again, whole, past that cap.
        batching = getattr(f, "plan_reads", None) is None
        for whole in wholes:
            if batching and whole.size < _SLICE_BYTES:
                if batch and not _extends(batch, whole):
                    failed += self._read_batch(f, batch)
                    batch = []
                batch.append(whole)
            elif not self._read_in_place(f, whole):
                failed.append(whole)
        if batch:
            failed += self._read_batch(f, batch)
        return failed

    def _plan_reads(self, f, items: list[ReadItem]) -> None:
        """Tell a file that fetches ahead (an object store's, :mod:`checkpoint.fsspec_storage`) the byte ranges
        of the items read whole, in order: it fetches them concurrently, holding them in :attr:`budget`. Items
        read in part (a reshard) are left out: only the bytes they need are read, when they are needed."""
        plan_reads = getattr(f, "plan_reads", None)
        if plan_reads is None:
            return
        ranges = []
        for item in items:
            info: StorageInfo = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO or self._reads_whole(item):
                ranges.append((info.offset, info.length))
        plan_reads(sorted(set(ranges)), self.budget)

    def _reads_whole(self, item: ReadItem) -> bool:
        md = self._planned.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)  # byte items are read whole
        return not any(item.storage_offsets) and tuple(item.lengths) == _chunk_sizes(md, item)

    def _verified(self, name: str, offset: int, *buffers) -> list[PendingSum]:
        """Hand ``buffers`` (read one after another from ``offset``) to the streamed check as one piece; the
        CRC-32 sums still running on them (they must stay alive until then)."""
        if self._check is None:
            return []
        summing = self._check.add_run(name, offset, list(buffers))
        return [] if summing is None else [summing]

    def _whole_chunk(self, info: StorageInfo, item: ReadItem, planner: LoadPlanner) -> _WholeChunk | None:
        """``item`` as a whole chunk whose bytes can land in its destination in one sequential read (see
        :meth:`_layout_of`); ``None`` for anything else: partial reads, a transform, another writer's archive."""
        if info.transform_descriptors:
            return None
        md = self._planned.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)  # byte items never come here
        chunk_sizes = _chunk_sizes(md, item)
        if any(item.storage_offsets) or tuple(item.lengths) != chunk_sizes:
            return None
        target = planner.resolve_tensor(item).detach()
        layout = self._layout_of(info, md.properties.dtype, chunk_sizes, target)
        return None if layout is None else _WholeChunk(item.storage_index.fqn, info, target, layout, item)

    def _stored_whole(self, key: str, target: torch.Tensor) -> _WholeChunk | None:
        """Key ``key`` as one stored chunk covering the whole tensor, read whole into ``target``; ``None``
        for anything else (several chunks, another shape, see :meth:`_layout_of`)."""
        if self._index is not None:  # every key is one piece there
            md = self._index.saved.get(key)
            if not isinstance(md, TensorStorageMetadata) or target.shape != md.size:  # torch.Size both
                return None
            return self._whole_at(key, self._index.stored_at(key), md, target)
        md = self._planned.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata) or len(md.chunks) != 1:
            return None
        chunk = md.chunks[0]
        sizes = tuple(md.size)
        if any(chunk.offsets) or tuple(chunk.sizes) != sizes or tuple(target.shape) != sizes:
            return None
        return self._whole_at(key, self._chunk_storage.get((key, chunk.offsets)), md, target)

    def _whole_at(
        self, key: str, info: StorageInfo | None, md: TensorStorageMetadata, target: torch.Tensor
    ) -> _WholeChunk | None:
        if info is None or info.transform_descriptors:
            return None
        layout = self._layout_of(info, md.properties.dtype, tuple(md.size), target)
        return None if layout is None else _WholeChunk(key, info, target, layout)

    @functools.cached_property
    def _chunk_storage(self) -> dict[tuple[str, tuple[int, ...]], StorageInfo]:
        """Where each tensor chunk is stored, by (key, offsets): what ``storage_data`` maps its
        ``MetadataIndex`` to. One pass over it, for the first whole tensor read: a ``MetadataIndex`` made
        and hashed per key (Python ``__init__`` and ``__hash__``) cost ~4x that pass at 40,000 tensors."""
        return {
            (index.fqn, index.offset): info
            for index, info in (self._planned.storage_data or {}).items()
            if index.offset is not None
        }

    def _layout_of(
        self, info: StorageInfo, dtype: torch.dtype, chunk_sizes: tuple[int, ...], target: torch.Tensor
    ) -> ArchiveLayout | None:
        """The archive our writer makes for a chunk of ``dtype`` and ``chunk_sizes``, when the chunk at
        ``info`` has its length and its bytes can be read straight into ``target`` (host memory, contiguous,
        that dtype, not empty); checked byte for byte once read (:meth:`_WholeChunk.matches`)."""
        if not _fills_in_place(target, dtype) or target.numel() == 0:
            return None
        key = (dtype, chunk_sizes, info.length)
        layout = self._layouts.get(key, _UNKNOWN)
        if layout is _UNKNOWN:
            layout = self._layouts[key] = stored_layout(dtype, chunk_sizes, info.length)
        return layout

    def _read_in_place(self, f, whole: _WholeChunk) -> bool:
        """A whole chunk read in slices (each one's CRC-32 summed while the next is read); ``False``
        (nothing committed; the caller's general path rewrites the whole destination) if it is not what
        :func:`checkpoint.chunk_archive.archive_layout` describes or the file ends early."""
        whole_read, summing = self._read_in_slices(f, whole.info, whole.buffers)
        if not whole_read or not whole.matches():
            # the general path may rewrite the destination: the sums of what was read here finish first
            for pending in summing:
                pending.result()
            return False
        return True

    def _read_batch(self, f, batch: list[_WholeChunk]) -> list[_WholeChunk]:
        """Small whole chunks lying back to back in the file: one ``preadv`` and one CRC-32 sum for the run.

        Anything unexpected in the run (a short read, an archive that is not ours) sends each of its chunks
        through the one-chunk path instead; returns the chunks that failed that too.
        """
        failed = []
        for i in range(0, len(batch), _BATCH_CHUNKS):
            run = batch[i : i + _BATCH_CHUNKS]
            buffers = [b for whole in run for b in whole.buffers]
            start = run[0].info.offset
            size = run[-1].info.offset + run[-1].info.length - start
            # two destinations sharing bytes (aliased values) would be summed after the second read: one at a time
            if _disjoint(run) and self._store.read_into(f, buffers, start) == size and all(w.matches() for w in run):
                if self._check is not None:
                    self._check.add_run(run[0].info.relative_path, start, buffers)
                continue
            failed += [whole for whole in run if not self._read_in_place(f, whole)]
        return failed

    def _read_in_slices(self, f, info: StorageInfo, buffers: list) -> tuple[bool, list[PendingSum]]:
        """Fill ``buffers`` from ``info.offset`` in reads of at most :data:`_SLICE_BYTES`, each slice handed to
        the streamed check as soon as it is read (its CRC-32 summed while the next is read). Returns whether
        all were filled, and the sums still running."""
        views = [memoryview(b).cast("B") for b in buffers]
        slices = [v[i : i + _SLICE_BYTES] for v in views for i in range(0, len(v), _SLICE_BYTES)]
        summing: list[PendingSum] = []
        at = info.offset
        batch: list[memoryview] = []
        for piece in slices:
            batch.append(piece)
            if len(piece) == _SLICE_BYTES or piece is slices[-1]:  # small head / tail pieces share a read
                size = sum(len(b) for b in batch)
                if self._store.read_into(f, batch, at) != size:
                    return False, summing
                summing += self._verified(info.relative_path, at, *batch)  # one piece per read: one hand-over
                at += size
                batch = []
        return True, summing

    def _read_tensor(self, f, path: Path, info: StorageInfo, location, item: ReadItem, planner: LoadPlanner) -> None:
        md = self._planned.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        chunk_sizes = _chunk_sizes(md, item)
        itemsize = md.properties.dtype.itemsize
        target = planner.resolve_tensor(item).detach()
        if location is None or location[1] != math.prod(chunk_sizes) * itemsize:
            # not a plain chunk archive: DCP's way (the archive's bytes, and the tensor torch.load makes of them)
            held = 2 * info.length
            self.budget.hold(held)
            saved, summing = self._load_whole(f, info, path)
        else:
            start, run = _contiguous_run(chunk_sizes, item.storage_offsets, item.lengths)
            # Raw bytes land in the target only when they mean the same thing there:
            # another dtype (fp32 moments into bf16 host moments) goes through copy_.
            if run is not None and _fills_in_place(target, md.properties.dtype):
                at = info.offset + location[0] + start * itemsize
                f.seek(at)
                buffer = target.reshape(-1).view(torch.uint8).numpy()
                _readinto(f, buffer, path)
                self._verified(info.relative_path, at, buffer)
                planner.commit_tensor(item, target)
                return
            held = location[1]
            self.budget.hold(held)
            saved = torch.empty(chunk_sizes, dtype=md.properties.dtype)
            f.seek(info.offset + location[0])
            buffer = saved.reshape(-1).view(torch.uint8).numpy()
            _readinto(f, buffer, path)
            summing = self._verified(info.relative_path, info.offset + location[0], buffer)
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            saved = saved.narrow(dim, offset, length)
        target.copy_(saved)
        planner.commit_tensor(item, target)
        self.budget.done(held, summing)

    def _load_whole(self, f, info: StorageInfo, path: Path) -> tuple[torch.Tensor, list[PendingSum]]:
        f.seek(info.offset)
        data = _read_exact(f, info.length, path)
        summing = self._verified(info.relative_path, info.offset, data)
        problem = value_problem(data)  # a plain DCP chunk is a torch.save archive: what it may cost, as values
        if problem is not None:
            raise CheckpointCorruptError(f"{path}: the chunk at byte {info.offset}: {problem}; restore the file")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), summing
        except Exception as exc:  # noqa: BLE001 - any failure to parse a damaged archive is the same error
            raise CheckpointCorruptError(
                f"{path}: the chunk at byte {info.offset} is not a tensor archive weights-only loading reads "
                f"({type(exc).__name__}); restore the file from a copy or re-save the checkpoint"
            ) from None


class _WholeChunk:
    """A read item that is one whole stored chunk of our writer's archive layout, and the buffers its head,
    data (the destination's own bytes) and tail are read into."""

    def __init__(
        self, key: str, info: StorageInfo, target: torch.Tensor, layout: ArchiveLayout, item: ReadItem | None = None
    ) -> None:
        self.key, self.info, self.target, self.layout = key, info, target, layout
        self.item = item  # None when read without a DCP plan (DirectReader.read_whole_tensors)
        self.head, self.tail = bytearray(len(layout.head)), bytearray(layout.tail_size)
        data = _bytes_of(target)
        self.buffers = [self.head, data, self.tail]
        self.size = info.length
        start = ctypes.addressof(data)
        self.span = (start, start + len(data))
        """the destination's bytes in memory: [start, end) addresses"""

    def matches(self) -> bool:
        """Whether the head and tail read are what our writer makes around this data (only then the data is
        known to be where it landed)."""
        return self.head == self.layout.head and self.tail == self.layout.tail(self.layout.data_crc(self.tail))


def _bytes_of(target: torch.Tensor) -> ctypes.Array:
    """A writable buffer over the bytes of ``target`` (host memory, contiguous, no conjugate / negative view bit:
    :func:`_fills_in_place`), for ``preadv`` and the CRC-32 to use directly.

    A ctypes array at its ``data_ptr()`` costs ~1.5 us where ``memoryview(t.reshape(-1).view(torch.uint8).numpy())``
    costs ~7-9 (a fifth of a small tensor's whole load); it holds no reference to the tensor, so the caller
    keeps ``target`` alive as long as the buffer (:class:`_WholeChunk` holds both).
    """
    return (ctypes.c_ubyte * target.nbytes).from_address(target.data_ptr())


def _disjoint(run: list[_WholeChunk]) -> bool:
    """Whether no two destinations of ``run`` share a byte."""
    spans = sorted(w.span for w in run)
    return all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))


def _extends(batch: list[_WholeChunk], whole: _WholeChunk) -> bool:
    """Whether ``whole`` starts where ``batch`` ends in the file, and the run stays within one slice."""
    last = batch[-1].info
    end = last.offset + last.length
    return whole.info.offset == end and end + whole.size - batch[0].info.offset <= _SLICE_BYTES


def _chunk_sizes(md: TensorStorageMetadata, item: ReadItem) -> tuple[int, ...]:
    index = item.storage_index
    assert index.offset is not None  # a tensor read item names its chunk's offset
    hint = index.index
    if hint is not None and hint < len(md.chunks) and tuple(md.chunks[hint].offsets) == tuple(index.offset):
        return tuple(md.chunks[hint].sizes)
    for chunk in md.chunks:
        if tuple(chunk.offsets) == tuple(index.offset):
            return tuple(chunk.sizes)
    raise ValueError(f"{index.fqn}: no stored chunk at offset {tuple(index.offset)}")


def _fills_in_place(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether file bytes can be read straight into ``target``: host memory (an accelerator tensor has no
    buffer to ``readinto``; it takes a host copy instead), contiguous, and of the saved dtype."""
    # a conjugate / negative view (complex .conj(), ._neg_view()) reads its storage transformed: raw bytes
    # written there would read back conjugated; copy_ into it writes what it should read
    return (
        target.is_cpu
        and target.is_contiguous()
        and target.dtype == dtype
        and not target.is_conj()
        and not target.is_neg()
    )


def _contiguous_run(sizes, offsets, lengths) -> tuple[int, int | None]:
    """Row-major start of a sub-box of a chunk, and its element count if it is one contiguous run."""
    start = 0
    for size, offset in zip(sizes, offsets):
        start = start * size + offset
    # A run: leading dims of length 1, one partial dim, then full trailing dims.
    dims = len(sizes)
    d = dims - 1
    while d >= 0 and lengths[d] == sizes[d]:
        d -= 1
    if any(lengths[k] != 1 for k in range(max(d, 0))):
        return start, None
    return start, math.prod(lengths)


def _tensor_bytes(f, info: StorageInfo) -> tuple[int, int] | None:
    """(offset within the item, size) of the one data record of a torch.save archive, or None."""
    try:
        return _find_tensor_bytes(f, info)
    except struct.error:  # a damaged directory: the caller's general path reports it
        return None


def _find_tensor_bytes(f, info: StorageInfo) -> tuple[int, int] | None:
    if info.length < _EOCD.size:
        return None
    f.seek(info.offset + info.length - _EOCD.size)
    sig, _, _, _, entries, cd_size, cd_offset, _ = _EOCD.unpack(f.read(_EOCD.size))
    if sig != b"PK\x05\x06" or _NO_VALUE in (cd_size, cd_offset) or cd_offset + cd_size > info.length:
        return None
    f.seek(info.offset + cd_offset)
    directory = f.read(cd_size)
    found = None
    pos = 0
    for _ in range(entries):
        fields = _CENTRAL.unpack_from(directory, pos)
        method, size, name_len, extra_len, comment_len, local_offset = (
            fields[4],
            fields[9],
            fields[10],
            fields[11],
            fields[12],
            fields[16],
        )
        name = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len]
        if name.endswith(b"/data/0"):
            if found is not None or method != 0 or _NO_VALUE in (size, local_offset):
                return None
            found = (local_offset, size)
        elif b"/data/" in name and not name.endswith(b"serialization_id"):
            return None  # more than one storage: not a plain chunk archive
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    if found is None:
        return None
    f.seek(info.offset + found[0])
    local = _LOCAL.unpack(f.read(_LOCAL.size))
    if local[0] != b"PK\x03\x04":
        return None
    return found[0] + _LOCAL.size + local[9] + local[10], found[1]


def _read_exact(f, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"{path}: ends {n - len(data)} bytes early (truncated)")
    return data


def _readinto(f, buffer, path: Path) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{path}: ends {len(view) - done} bytes early (truncated)")
        done += n
