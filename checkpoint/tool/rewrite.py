"""Write an ``fsdp_dtensor`` checkpoint for M ranks from a stream of full tensors (reshard / import).

A converter holds one global tensor at a time, so it writes *tensor-major*: each
tensor is cut into the M ranks' row blocks (FSDP2's ``torch.chunk`` layout on
dim 0; a rank past the last row gets nothing), each block into chunks of at
most ``max_chunk_bytes`` bytes (:func:`checkpoint.layout.split_box`, as a save
cuts them: whole rows where they fit, else parts of a row), and each chunk is
appended to its rank's data file ``__<rank>_0.distcp``. Writing rank by rank
through ``dcp.save`` instead would need either a whole rank's share in memory
(the whole model when M = 1) or re-reading every source tensor once per rank.

The files are laid out as DCP's ``FileSystemWriter`` lays them out (one
``torch.save``-compatible archive per chunk, written from the tensor's raw
bytes through :class:`checkpoint.data_file.DataFile`, the writer
:class:`~checkpoint.storage.FsdpWriter` uses; non-tensor values as ``torch.save``
bytes, ``.metadata`` a :class:`~torch.distributed.checkpoint.metadata.Metadata`
built by :class:`checkpoint.dcp_metadata.MetadataBuilder`),
so ``dcp.load``, ``dcp_to_torch_save`` and :mod:`checkpoint` read them.
Staging and commit are the format's own (:func:`checkpoint.commit.commit_staged`
in the staging directory of :mod:`checkpoint.atomic`): data files fsynced, the
manifest with sizes and CRC-32 (computed while writing) last, then the
crash-safe swap into place.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from checkpoint.atomic import check_target, make_staging, remove_staging, staging_path, write_lock
from checkpoint.commit import commit_staged
from checkpoint.data_file import DataFile, StorageInfo, data_file_name
from checkpoint.dcp_metadata import MetadataBuilder, write_metadata
from checkpoint.layout import Box, row_block, split_box
from checkpoint.manifest import METADATA_NAME, FileRecord
from checkpoint.object_commit import is_checkpoint, protocol_for
from checkpoint.storage_backend import locate
from checkpoint.tool.cli_parallel import SOLO, Group
from checkpoint.tool.transforms import Target
from checkpoint.training_state import key_path

__all__ = ["row_blocks", "write_checkpoint"]

logger = logging.getLogger(__name__)


def row_blocks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, count)`` of dim-0 rows per rank, as FSDP2's ``torch.chunk`` splits them (empty tail ranks)."""
    per_rank = -(-rows // world_size) if rows else 0
    out = []
    for rank in range(world_size):
        start = min(rank * per_rank, rows)
        out.append((start, min(per_rank, rows - start)))
    return out


def _chunks_of(
    shape: tuple[int, ...], itemsize: int, world_size: int, max_chunk_bytes: int
) -> Iterator[tuple[int, Box]]:
    """``(rank, box)`` of every stored chunk of a tensor of ``shape``: each rank's row block, cut by :func:`split_box`."""
    if not shape or math.prod(shape) == 0:
        # a 0-d tensor cannot be cut; an empty one is still one (empty) chunk, so its key and shape are recorded
        yield 0, Box((0,) * len(shape), shape)
        return
    for rank, (start, count) in enumerate(row_blocks(shape[0], world_size)):
        if count:
            for box in split_box(row_block(shape, start, count), itemsize, max_chunk_bytes):
                yield rank, box


def write_checkpoint(
    dst: Path,
    world_size: int,
    targets: list[Target],
    values: Iterable[tuple[Target, Any]],
    *,
    max_chunk_bytes: int = 64 << 20,
    on_bytes: Callable[[int], None] | None = None,
    replace: bool = False,
    extra_info: dict[str, Any] | None = None,
    group: Group = SOLO,
    paths: dict[str, tuple] | None = None,
) -> None:
    """Write ``values`` (one per target, in order) as a committed checkpoint laid out for ``world_size`` ranks.

    ``dst`` must be absent or empty, or (with ``replace``) a committed
    checkpoint, which stays loadable until the new one is complete. Raises
    ``FileExistsError`` otherwise, ``ValueError`` when a value does not match
    its target or ``max_chunk_bytes`` is smaller than one element. Under ``torchrun`` (``group`` of P processes) every process
    streams every value and writes the data files of the destination ranks
    ``r`` with ``r % P`` equal to its own rank; process 0 commits. ``paths`` (the source
    checkpoint's ``planner_data``) keeps the nesting of the keys copied unchanged,
    so ``checkpoint.load`` returns the same nested ``extra``.
    """
    itemsize = max((t.tensor_dtype.itemsize for t in targets if t.kind == "tensor"), default=1)
    if max_chunk_bytes < itemsize:
        raise ValueError(
            f"max chunk size {max_chunk_bytes} B is smaller than one element ({itemsize} B); pass a larger one"
        )
    dst = locate(dst)
    protocol = protocol_for(dst)
    if protocol.needs_agreement:  # a URL / shared file system: the object-store protocol
        _write_by_objects(
            dst, protocol, world_size, targets, values, max_chunk_bytes, on_bytes, replace, extra_info, group, paths
        )
        return
    staging = staging_path(dst)
    with contextlib.ExitStack() as held:
        error = None
        if group.rank == 0:
            try:
                held.enter_context(write_lock(dst))  # one writer per path, until committed
                _prepare(dst, replace)
            except BaseException as exc:  # noqa: BLE001 - handed to every process by agree()
                error = exc
        group.agree(error)  # staging exists (and is empty) before anyone writes into it
        try:
            _write_and_commit(
                dst, staging, world_size, targets, values, max_chunk_bytes, on_bytes, extra_info, group, paths
            )
        except BaseException:
            if group.rank == 0:  # every process has stopped writing: agree() raised on all of them
                remove_staging(dst)
            raise


def _write_by_objects(
    dst, protocol, world_size, targets, values, max_chunk_bytes, on_bytes, replace, extra_info, group, paths
) -> None:
    """:func:`write_checkpoint` to a storage without renames (:mod:`checkpoint.object_commit`): one process."""
    if group.size != 1:
        raise ValueError(f"writing to {str(dst)!r} (an object store) runs in one process: run it without torchrun")
    if not replace and is_checkpoint(dst):
        raise FileExistsError(f"output {str(dst)!r} exists and is not empty; choose a new path or pass --force")
    with contextlib.ExitStack() as held:
        staged = protocol.begin(held)  # refuses a path holding anything but a checkpoint
        try:
            _write_and_commit(
                dst, staged, world_size, targets, values, max_chunk_bytes, on_bytes, extra_info, group, paths, protocol
            )
        except BaseException:
            protocol.abandon(staged)
            raise


def _write_and_commit(
    dst, staging, world_size, targets, values, max_chunk_bytes, on_bytes, extra_info, group, paths, protocol=None
) -> None:
    files = {r: DataFile(staging, _file_name(r)) for r in range(world_size) if group.mine(r)}
    builder = MetadataBuilder()  # every process declares every chunk; each records where its own landed
    storage: dict[MetadataIndex, StorageInfo] = {}
    records: dict[str, FileRecord] = {}
    error = None
    try:
        for target, value in values:
            if isinstance(value, torch.Tensor):
                _check(target, value)
                _write_tensor(target.name, value, files, builder, storage, world_size, max_chunk_bytes)
                if on_bytes is not None:
                    on_bytes(value.numel() * value.element_size())
                del value  # before the loop reads the next tensor
            else:
                where = None
                if 0 in files:  # non-tensor values live in rank 0's file
                    buf = io.BytesIO()
                    torch.save(value, buf)
                    where = storage[MetadataIndex(target.name)] = files[0].add_bytes(buf.getbuffer())
                builder.byte_value(target.name, where)
        declared = set(builder.keys())
        missing = [t.name for t in targets if t.name not in declared]
        if missing:
            raise ValueError(f"no value arrived for {missing[:3]} (internal error; report it)")
        records = {f.name: f.finish() for f in files.values()}
    except BaseException as exc:  # noqa: BLE001 - handed to every process by agree()
        for f in files.values():
            f.abort()
        error = exc
    group.agree(error)
    parts = group.gather((storage, records))
    error = None
    if group.rank == 0:
        try:
            kept = {t.name: (paths or {}).get(t.name) for t in targets if t.op == "copy" and t.name == t.sources[0]}
            _commit(dst, staging, world_size, builder, parts, max_chunk_bytes, extra_info, kept, protocol)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    group.agree(error)


def _prepare(dst: Path, replace: bool) -> None:
    if dst.exists() and not replace and (dst.is_file() or any(dst.iterdir())):
        raise FileExistsError(f"output {str(dst)!r} exists and is not empty; choose a new path or pass --force")
    if replace:
        check_target(dst)  # a committed checkpoint holding only its own files, an empty directory, or nothing
    make_staging(dst)  # an unfinished save of this path (marked as ours) is removed; anything else is refused


def _commit(
    dst, staging, world_size, builder: MetadataBuilder, parts, max_chunk_bytes, extra_info, paths, protocol=None
) -> None:
    """Merge every process's storage records, write ``.metadata``, then the format's own commit."""
    records: dict[str, FileRecord] = {}
    for part_storage, part_records in parts:
        builder.storage(part_storage)
        records.update(part_records)
    for key in builder.keys():
        # each key's nested path, as dcp.save records it: checkpoint.load rebuilds `extra` from it
        builder.path(key, key_path(key, paths))
    metadata = builder.build()
    records[METADATA_NAME] = write_metadata(staging, metadata)
    info = {"writer": "fsdp-ckpt", "layout": "dim-0 row blocks", "max_chunk_bytes": max_chunk_bytes}
    extra_info = {**info, **(extra_info or {})}
    commit_staged(dst, metadata, records, world_size, extra_info=extra_info, staged=staging, protocol=protocol)


def _check(target: Target, value: torch.Tensor) -> None:
    if target.kind != "tensor" or tuple(value.shape) != target.shape:
        raise ValueError(
            f"{target.name!r}: got shape {list(value.shape)} where {list(target.shape)} was planned (internal error; report it)"
        )


def _write_tensor(name, value, files, builder, storage, world_size, max_chunk_bytes) -> None:
    builder.tensor(name, value.dtype, value.shape)
    for rank, (offsets, sizes) in _chunks_of(tuple(value.shape), value.element_size(), world_size, max_chunk_bytes):
        out = files.get(rank)
        if out is None:  # another torchrun process writes this rank's file
            builder.chunk(name, offsets, sizes)
            continue
        piece = value
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            piece = piece.narrow(dim, o, s)
        where = storage[MetadataIndex(name, torch.Size(offsets))] = out.add_tensor(piece)
        builder.chunk(name, offsets, sizes, where)


def _file_name(rank: int) -> str:
    """Rank ``rank``'s data file, named as DCP's ``FileSystemWriter`` names it."""
    return data_file_name(f"__{rank}_")
