"""Committing a checkpoint: per-rank writes, the metadata merge, the manifest, the swap.

Scale mode and single-process layouts for M ranks use the same two calls::

    for rank in range(M):                        # one process, or each rank on its own
        checkpoint.write_rank(path, rank, M, state_dict_of_rank)   # values may be shard(...) objects
    checkpoint.commit(path, M)                   # once, after every rank's write_rank returned

``write_rank`` writes ``__<rank>_0.distcp``, ``__<rank>.metadata`` and
``__<rank>.files.json`` into the staging directory ``<path>.tmp`` and talks to
nobody. ``commit`` merges the per-rank metadata into one DCP ``.metadata``
(validating bounds, overlaps and exact cover), drops the per-rank files,
writes ``manifest.json`` last and swaps the directory into ``path``
(:mod:`checkpoint.atomic`). The result is an ordinary checkpoint that any
world size, and plain DCP, can read.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from checkpoint.atomic import staging_path, swap_into_place
from checkpoint.convert import convert_tree
from checkpoint.manifest import FileRecord, KeyRecord, Manifest, checksum_file, write_manifest
from checkpoint.planner import FsdpSavePlanner, metadata_problems
from checkpoint.storage import FsdpWriter, quiet_single_process, read_rank_files

__all__ = ["DEFAULT_MAX_CHUNK_BYTES", "build_manifest", "commit", "commit_staged", "merge_metadata", "write_rank"]

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"
DEFAULT_MAX_CHUNK_BYTES = 64 << 20
"""Chunks are cut to at most this many bytes so a reshard reads little beyond what it needs."""


def write_rank(
    path: str | os.PathLike,
    rank: int,
    world_size: int,
    state_dict: dict[str, Any],
    *,
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
) -> None:
    """Write rank ``rank``'s part of a checkpoint for ``world_size`` ranks, without any communication.

    ``state_dict`` is nested dicts of tensors, DTensors, ``shard(...)`` objects
    and picklable values, holding what *this* rank owns. Plain tensors are
    taken as replicas and written by rank 0 only. Nothing is visible at
    ``path`` until :func:`commit`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    converted = convert_tree(state_dict, rank=rank, replicas_on_rank0_only=True, max_chunk_bytes=max_chunk_bytes)
    writer = FsdpWriter(staging_path(path), force_rank=rank)
    with quiet_single_process():
        dcp.save(converted, storage_writer=writer, planner=FsdpSavePlanner(validate_cover=False), no_dist=True)


def commit(path: str | os.PathLike, world_size: int, *, extra_info: dict | None = None) -> None:
    """Merge the ``world_size`` ranks written by :func:`write_rank` (or a scale-mode save) and commit ``path``.

    One process only. Raises ``ValueError`` naming the rank whose files are
    missing or the key whose chunks are inconsistent; nothing at ``path``
    changes then.
    """
    staged = staging_path(path)
    per_rank: list[Metadata] = []
    files: dict[str, FileRecord] = {}
    for rank in range(world_size):
        md_path = staged / f"__{rank}{METADATA_NAME}"
        if not md_path.exists():
            raise ValueError(f"cannot commit {str(path)!r}: rank {rank} did not finish writing ({md_path} is missing)")
        with open(md_path, "rb") as f:
            per_rank.append(pickle.load(f))
        files.update(read_rank_files(staged, rank))
    merged = merge_metadata(per_rank)
    problems = metadata_problems(merged)
    if problems:
        raise ValueError(f"cannot commit {str(path)!r}: " + "; ".join(problems[:5]))
    _write_metadata(staged, merged)
    info = {"mode": "scale", **(extra_info or {})}
    commit_staged(path, merged, files, world_size, extra_info=info)


def merge_metadata(per_rank: list[Metadata]) -> Metadata:
    """One DCP ``Metadata`` from per-rank ones, in rank order; replicas (same key and offset) kept once.

    Raises ``ValueError`` when ranks disagree on a key's global shape or dtype.
    """
    state: dict[str, Any] = {}
    seen: dict[str, set] = {}
    storage: dict[Any, Any] = {}
    planner_data: dict[str, Any] = {}
    for rank, md in enumerate(per_rank):
        for key, item in md.state_dict_metadata.items():
            current = state.get(key)
            if isinstance(item, BytesStorageMetadata):
                if current is None:
                    state[key] = item
                continue
            if current is None:
                current = state[key] = TensorStorageMetadata(item.properties, item.size, [])
                seen[key] = set()
            elif not isinstance(current, TensorStorageMetadata) or current.size != item.size:
                raise ValueError(f"ranks disagree on key {key!r}: rank {rank} has shape {tuple(item.size)}")
            elif current.properties.dtype != item.properties.dtype:
                raise ValueError(f"ranks disagree on the dtype of {key!r}: rank {rank} has {item.properties.dtype}")
            marks = seen[key]
            for chunk in item.chunks:
                if chunk.offsets not in marks:
                    marks.add(chunk.offsets)
                    current.chunks.append(chunk)
        for index, info in (md.storage_data or {}).items():
            storage.setdefault(index, info)
        for key, path in (md.planner_data or {}).items():
            planner_data.setdefault(key, path)
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=None,
        version=CURRENT_DCP_VERSION,
    )


def _write_metadata(directory: Path, metadata: Metadata) -> None:
    tmp = directory / (METADATA_NAME + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / METADATA_NAME)


def build_manifest(
    metadata: Metadata, files: dict[str, FileRecord], world_size: int, extra_info: dict | None = None
) -> Manifest:
    keys = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            keys[key] = KeyRecord("tensor", str(item.properties.dtype).removeprefix("torch."), tuple(item.size))
        else:
            keys[key] = KeyRecord("bytes")
    return Manifest(world_size=world_size, keys=keys, files=dict(files), extra_info=dict(extra_info or {}))


def commit_staged(
    path: str | os.PathLike,
    metadata: Metadata,
    files: dict[str, FileRecord],
    world_size: int,
    *,
    extra_info: dict | None = None,
) -> None:
    """Prune stray files from the staging dir, write the manifest (the commit point), swap into ``path``.

    Precondition: ``.metadata`` and every file in ``files`` are durable in the staging directory.
    """
    staged = staging_path(path)
    referenced = {info.relative_path for info in (metadata.storage_data or {}).values()}
    keep = {name: rec for name, rec in files.items() if name in referenced}
    for entry in staged.iterdir():
        if entry.name not in keep and entry.name != METADATA_NAME:
            # Leftovers of an earlier, killed save (another world size) or per-rank files now merged.
            entry.unlink()
    keep[METADATA_NAME] = checksum_file(staged / METADATA_NAME)
    write_manifest(staged, build_manifest(metadata, keep, world_size, extra_info))
    swap_into_place(staged, path)
    logger.info("committed checkpoint %s (%d files, %d keys)", path, len(keep), len(metadata.state_dict_metadata))

