"""Write an ``fsdp_dtensor`` checkpoint for M ranks from a stream of full tensors (reshard / import).

A converter holds one global tensor at a time, so it writes *tensor-major*: each
tensor is cut into the M ranks' row blocks (FSDP2's ``torch.chunk`` layout on
dim 0; a rank past the last row gets nothing), each block into chunks of at
most ``max_chunk_bytes`` rows, and each chunk is appended to its rank's data
file ``__<rank>_0.distcp``. Writing rank by rank through ``dcp.save`` instead
would need either a whole rank's share in memory (the whole model when M = 1)
or re-reading every source tensor once per rank.

The files are exactly what DCP's ``FileSystemWriter`` produces (one
``torch.save`` record per chunk, non-tensor values as ``torch.save`` bytes,
``.metadata`` a pickled :class:`~torch.distributed.checkpoint.metadata.Metadata`),
so ``dcp.load``, ``dcp_to_torch_save`` and :mod:`checkpoint` read them.
The save is atomic: everything is written to ``<dst>.fsdp-ckpt-tmp``, fsynced,
the manifest (the commit record, with sizes and CRC-32 of every file) goes
last, and the directory is renamed into place.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import shutil
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint.manifest import FileRecord, KeyRecord, Manifest, fsync_dir, write_manifest
from checkpoint.stream import dtype_name
from checkpoint.transforms import Target

__all__ = ["STAGING_SUFFIX", "row_blocks", "write_checkpoint"]

logger = logging.getLogger(__name__)

STAGING_SUFFIX = ".fsdp-ckpt-tmp"
_DCP_METADATA_VERSION = "1.0.0"  # what torch 2.6-2.13 write; readers ignore unknown values


def row_blocks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, count)`` of dim-0 rows per rank, as FSDP2's ``torch.chunk`` splits them (empty tail ranks)."""
    per_rank = -(-rows // world_size) if rows else 0
    out = []
    for rank in range(world_size):
        start = min(rank * per_rank, rows)
        out.append((start, min(per_rank, rows - start)))
    return out


class _CrcFile:
    """An append-only binary file that keeps its size and CRC-32 as it is written (no second read)."""

    def __init__(self, path: Path) -> None:
        self.name = path.name
        self._f = open(path, "wb")
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> FileRecord:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return FileRecord(size=self.size, crc32=self.crc)


def _chunks_of(shape: tuple[int, ...], itemsize: int, world_size: int, max_chunk_bytes: int):
    """``(rank, offsets, sizes)`` of every stored chunk of a tensor of ``shape``."""
    if not shape:
        yield 0, (), ()
        return
    if math.prod(shape) == 0:
        # still one (empty) chunk, so the key and its shape are recorded
        yield 0, (0,) * len(shape), shape
        return
    row_bytes = math.prod(shape[1:]) * itemsize
    rows_per_chunk = max(1, max_chunk_bytes // max(row_bytes, 1))
    for rank, (start, count) in enumerate(row_blocks(shape[0], world_size)):
        for s in range(start, start + count, rows_per_chunk):
            n = min(rows_per_chunk, start + count - s)
            yield rank, (s,) + (0,) * (len(shape) - 1), (n,) + shape[1:]


def write_checkpoint(
    dst: Path,
    world_size: int,
    targets: list[Target],
    values: Iterable[tuple[Target, Any]],
    *,
    max_chunk_bytes: int = 256 << 20,
    on_bytes: Callable[[int], None] | None = None,
    replace: bool = False,
) -> Manifest:
    """Write ``values`` (one per target, in order) as a committed checkpoint laid out for ``world_size`` ranks.

    ``dst`` must not exist unless ``replace`` (then it must be a checkpoint
    directory or empty, and is replaced only once the new one is complete).
    Raises ``ValueError`` when a value's dtype or shape differs from its target.
    """
    dst = Path(dst)
    staging = dst.with_name(dst.name + STAGING_SUFFIX)
    if staging.exists():
        shutil.rmtree(staging)  # left by an interrupted run of this tool: never a checkpoint
    staging.mkdir(parents=True)
    files = [_CrcFile(staging / f"__{rank}_0.distcp") for rank in range(world_size)]
    state_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    keys: dict[str, KeyRecord] = {}
    try:
        for target, value in values:
            if isinstance(value, torch.Tensor):
                _check(target, value)
                state_md[target.name] = _write_tensor(target.name, value, files, storage, world_size, max_chunk_bytes)
                keys[target.name] = KeyRecord("tensor", dtype_name(value.dtype), tuple(value.shape))
                if on_bytes is not None:
                    on_bytes(value.numel() * value.element_size())
            else:
                buf = io.BytesIO()
                torch.save(value, buf)
                storage[MetadataIndex(target.name)] = _StorageInfo(files[0].name, files[0].size, buf.tell())
                files[0].write(buf.getbuffer())
                state_md[target.name] = BytesStorageMetadata()
                keys[target.name] = KeyRecord("bytes")
        missing = [t.name for t in targets if t.name not in state_md]
        if missing:
            raise ValueError(f"no value arrived for {missing[:3]} (internal error; report it)")
        records = {f.name: f.close() for f in files}
    except BaseException:
        for f in files:
            f._f.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    metadata = Metadata(
        state_dict_metadata=state_md,
        planner_data={k: (k,) for k in state_md},
        storage_data=storage,
        version=_DCP_METADATA_VERSION,
    )
    meta_path = staging / ".metadata"
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    from checkpoint.manifest import checksum_file

    records[".metadata"] = checksum_file(meta_path)
    manifest = Manifest(
        world_size=world_size,
        keys=keys,
        files=records,
        extra_info={"writer": "fsdp-ckpt", "layout": "dim0 row blocks", "max_chunk_bytes": max_chunk_bytes},
    )
    write_manifest(staging, manifest)
    _swap(staging, dst, replace)
    logger.info("committed %s: %d keys, %d ranks", dst, len(keys), world_size)
    return manifest


def _check(target: Target, value: torch.Tensor) -> None:
    if target.kind != "tensor" or tuple(value.shape) != target.shape:
        raise ValueError(
            f"{target.name!r}: got shape {list(value.shape)} where {list(target.shape)} was planned (internal error; report it)"
        )


def _write_tensor(name, value, files, storage, world_size, max_chunk_bytes) -> TensorStorageMetadata:
    shape = tuple(value.shape)
    chunks = []
    for rank, offsets, sizes in _chunks_of(shape, value.element_size(), world_size, max_chunk_bytes):
        piece = value
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            piece = piece.narrow(dim, o, s)
        # torch.save stores a view's whole storage: save a compact copy of the chunk only
        if piece.untyped_storage().nbytes() != piece.numel() * piece.element_size() or not piece.is_contiguous():
            piece = piece.contiguous().clone()
        out = files[rank]
        start = out.size
        torch.save(piece, out)
        storage[MetadataIndex(name, torch.Size(offsets))] = _StorageInfo(out.name, start, out.size - start)
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=value.dtype), size=torch.Size(shape), chunks=chunks
    )


def _swap(staging: Path, dst: Path, replace: bool) -> None:
    if dst.exists():
        if not replace:
            raise FileExistsError(f"output {str(dst)!r} appeared while writing; remove it or pass --force")
        if dst.is_file() or not (not any(dst.iterdir()) or (dst / ".metadata").exists()):
            raise ValueError(
                f"refusing to replace {str(dst)!r}: it is neither empty nor a checkpoint; choose another output path"
            )
        old = dst.with_name(dst.name + ".fsdp-ckpt-old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(staging, dst)
        shutil.rmtree(old)
    else:
        os.replace(staging, dst)
    fsync_dir(dst.parent)
