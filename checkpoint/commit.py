"""Committing a checkpoint: per-rank writes, the metadata merge, the manifest, the swap.

Scale mode and single-process layouts for M ranks use the same two calls::

    for rank in range(M):                        # one process, or each rank on its own
        checkpoint.write_rank(path, rank, M, state_dict_of_rank)   # values may be shard(...) objects
    checkpoint.commit(path, M)                   # once, after every rank's write_rank returned

``write_rank`` writes ``__<rank>_0.distcp`` and then its record
``__<rank>.rank.json`` into the staging directory ``.<name>.fsdp-ckpt-staging``
and talks to nobody. ``commit`` merges the per-rank records into one DCP ``.metadata``
(validating bounds, overlaps and exact cover), drops the per-rank files,
writes ``manifest.json`` last and swaps the directory into ``path``
(:mod:`checkpoint.atomic`). The result is an ordinary checkpoint that any
world size, and plain DCP, can read.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.atomic import (
    MARKER_NAME,
    check_target,
    make_staging,
    output_path,
    staging_path,
    swap_into_place,
    write_lock,
)
from checkpoint.convert import convert_tree
from checkpoint.data_file import StorageInfo
from checkpoint.dcp_metadata import MetadataBuilder, key_identities, shared_values, write_metadata
from checkpoint.load_index import load_index
from checkpoint.manifest import (
    METADATA_NAME,
    FileRecord,
    KeyRecord,
    LoadIndex,
    Manifest,
    SharedValues,
    dtype_name,
    verify_files,
    write_manifest,
)
from checkpoint.object_commit import SaveProtocol
from checkpoint.opener import storage_problems
from checkpoint.planner import FsdpSavePlanner, metadata_problems
from checkpoint.save_errors import raise_unwrapped
from checkpoint.storage import FsdpWriter, quiet_single_process, rank_record_name, rank_record_problem
from checkpoint.storage_backend import storage_for

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ManifestKeys",
    "build_manifest",
    "commit",
    "commit_staged",
    "manifest_keys",
    "merge_metadata",
    "new_save_id",
    "staged_save_id",
    "write_metadata",
    "write_rank",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK_BYTES = 64 << 20
"""Chunks are cut to at most this many bytes so a reshard reads little beyond what it needs."""
SAVE_ID_NAME = ".fsdp-ckpt-save-id"
"""In the staging directory of a scale-mode save: the id every rank puts in its record (not committed)"""


def write_rank(
    path: str | os.PathLike,
    rank: int,
    world_size: int,
    state_dict: dict[str, Any],
    *,
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    save_id: str | None = None,
) -> None:
    """Write rank ``rank``'s part of a checkpoint for ``world_size`` ranks, without any communication.

    ``state_dict`` is nested dicts of tensors, DTensors, ``shard(...)`` objects
    and picklable values, holding what *this* rank owns. Plain tensors are
    taken as replicas and written by rank 0 only. Nothing is visible at
    ``path`` until :func:`commit`. ``save_id`` (any string naming this save, e.g. its step) is kept in the
    rank's record: give every rank and :func:`commit` the same one, and a record left by an earlier,
    unfinished save to ``path`` (a rank that was not written again) is refused instead of merged.
    """
    path = output_path(path)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    _renames_only(path, "write_rank")
    converted = convert_tree(state_dict, rank=rank, replicas_on_rank0_only=True, max_chunk_bytes=max_chunk_bytes)
    # Ranks may be written by separate processes at once: the staging dir is shared, not made afresh.
    writer = FsdpWriter(make_staging(path, fresh=False), force_rank=rank, world_size=world_size, save_id=save_id)
    try:
        with quiet_single_process():
            dcp.save(converted, storage_writer=writer, planner=FsdpSavePlanner(validate_cover=False), no_dist=True)
    except CheckpointException as exc:
        raise_unwrapped(exc, path)


def commit(
    path: str | os.PathLike, world_size: int, *, extra_info: dict | None = None, save_id: str | None = None
) -> None:
    """Merge the ``world_size`` ranks written by :func:`write_rank` (or a scale-mode save) and commit ``path``.

    One process only; waits while another save writes ``path``. ``save_id``: the one every
    :func:`write_rank` of this save was given (a rank record of any other save is refused); without it,
    every record must carry the same id (or none). Raises ``ValueError`` naming the rank whose files are
    missing, whose record is not valid or is of another save, or the key whose chunks are inconsistent,
    ``FileExistsError`` when ``path`` holds something other than a checkpoint; nothing at ``path`` changes then.
    """
    path = output_path(path)
    _renames_only(path, "commit")
    with write_lock(path):
        check_target(path)
        commit_ranks(path, world_size, extra_info=extra_info, save_id=save_id)


def _renames_only(path: str | os.PathLike, what: str) -> None:
    if not storage_for(path).renames_atomically:
        raise ValueError(
            f"checkpoint.{what}({str(path)!r}): ranks written by separate calls commit by renames, which this "
            "storage (an object store / shared file system) lacks; save with "
            "checkpoint.save_state_dict(..., mode='scale') from every rank instead"
        )


def commit_ranks(
    path: str | os.PathLike,
    world_size: int,
    *,
    extra_info: dict | None = None,
    save_id: str | None = None,
    staged: PurePath | None = None,
    protocol: SaveProtocol | None = None,
) -> None:
    """:func:`commit` for a caller already holding ``path``'s write lock (a scale-mode save's rank 0);
    ``staged`` / ``protocol``: the save's staging directory and commit protocol (default: renames)."""
    staged = staging_path(path) if staged is None else staged
    records = [_read_rank_record(path, staged, rank, world_size) for rank in range(world_size)]
    ids = {record.get("save_id") for record in records}
    expected = save_id if save_id is not None else records[0].get("save_id")
    if ids != {expected}:
        strays = [rank for rank, record in enumerate(records) if record.get("save_id") != expected]
        raise ValueError(
            f"cannot commit {str(path)!r}: the records of ranks {strays[:8]} were written by another save "
            f"than {expected!r} (a leftover of an earlier, unfinished save); write those ranks again"
        )
    merged, files = merge_metadata(records)
    # Nothing is vouched for that a load would refuse: the chunks' cover, where they are stored, the files' sizes.
    problems = metadata_problems(merged) + storage_problems(merged, files)
    problems += verify_files(staged, Manifest(world_size=world_size, keys={}, files=files), checksums=False)
    if problems:
        raise ValueError(f"cannot commit {str(path)!r}: " + "; ".join(problems[:5]) + "; write those ranks again")
    files[METADATA_NAME] = write_metadata(staged, merged)
    info = {"mode": "scale", **(extra_info or {})}
    rank_records = [rank_record_name(rank) for rank in range(world_size)]
    commit_staged(
        path,
        merged,
        files,
        world_size,
        extra_info=info,
        staged=staged,
        protocol=protocol,
        written=[*rank_records, SAVE_ID_NAME],
    )


def new_save_id(staged: PurePath) -> str:
    """A fresh id for the save staged in ``staged``, kept there for the other ranks to read
    (:func:`staged_save_id`). Rank 0 of a scale-mode save, after it made the staging directory afresh."""
    save_id = uuid.uuid4().hex
    where = staged / SAVE_ID_NAME
    storage_for(where).write_file(where, save_id)
    return save_id


def staged_save_id(staged: PurePath) -> str:
    """The id :func:`new_save_id` gave the save staged in ``staged``."""
    where = staged / SAVE_ID_NAME
    with storage_for(where).open_read(where) as f:
        return f.read(64).decode("ascii")


def _read_rank_record(path: str | os.PathLike, staged: PurePath, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s record in ``staged``, parsed and checked; ``ValueError`` naming the file otherwise."""
    record_path = staged / rank_record_name(rank)
    store = storage_for(record_path)
    if store.stat(record_path, follow_symlinks=True) is None:
        raise ValueError(f"cannot commit {str(path)!r}: rank {rank} did not finish writing ({record_path} is missing)")
    with store.open_read(record_path) as f:
        raw = f.read(_MAX_RECORD_BYTES + 1)
    record: Any = None
    try:
        if len(raw) > _MAX_RECORD_BYTES:
            raise ValueError(f"larger than {_MAX_RECORD_BYTES} bytes")
        record = json.loads(raw)
        problem = rank_record_problem(record)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, deep nesting, too large
        problem = f"not valid JSON ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    if problem is not None or not isinstance(record, dict):
        raise ValueError(
            f"cannot commit {str(path)!r}: {record_path} is not a valid rank record: {problem}; write rank {rank} again"
        )
    if record["world_size"] != world_size:
        raise ValueError(
            f"cannot commit {str(path)!r}: {record_path} was written for world size "
            f"{record['world_size']}, not {world_size} (a leftover of another save); write rank {rank} again"
        )
    return record


_MAX_RECORD_BYTES = 1 << 30


def merge_metadata(records: list[dict]) -> tuple[Metadata, dict[str, FileRecord]]:
    """One DCP ``Metadata`` (and the file records) from per-rank records, in rank order.

    A record is what a rank writes in scale mode (``__<rank>.rank.json``, see
    :func:`checkpoint.storage.rank_record`). Replicas (same key and offset) are
    kept once, from the lowest rank. Raises ``ValueError`` when ranks disagree
    on a key's global shape or dtype.
    """
    builder = MetadataBuilder()
    files: dict[str, FileRecord] = {}
    for rank, record in enumerate(records):
        for key, item in record["tensors"].items():
            builder.tensor(key, getattr(torch, item["dtype"]), item["size"], source=f"rank {rank}")
            for offsets, sizes, name, offset, length in item["chunks"]:
                builder.chunk(key, offsets, sizes, StorageInfo(name, offset, length))
        for key, (name, offset, length) in record["bytes"].items():
            builder.byte_value(key, StorageInfo(name, offset, length))
        for key, path in record["planner_data"].items():
            builder.path(key, path)
        for name, (size, crc) in record["files"].items():
            files[name] = FileRecord(size=size, crc32=crc)
    return builder.build(), files


ManifestKeys = tuple[dict[str, KeyRecord], tuple[SharedValues, ...], LoadIndex | None]
"""A manifest's ``keys``, ``shared`` and ``load_index`` (:func:`manifest_keys`)."""


def manifest_keys(metadata: Metadata) -> ManifestKeys:
    """What a manifest records of ``metadata``'s keys: a record per key (kind, dtype, shape, identity), but for
    the byte keys it lists by the value they share (:func:`~checkpoint.dcp_metadata.shared_values`), and where
    each is stored when each is one piece (:func:`~checkpoint.load_index.load_index`).

    Linear in the keys and chunks; a collective save keeps it with its plan while ``.metadata`` is unchanged.
    """
    keys = {}
    shared = shared_values(metadata)  # listed once per family, not key by key
    listed = {key for family in shared for key, _, _ in family.keys()}
    identities = key_identities(metadata, skip=listed)
    for key, item in metadata.state_dict_metadata.items():
        if key in listed:
            continue
        if isinstance(item, TensorStorageMetadata):
            keys[key] = KeyRecord("tensor", dtype_name(item.properties.dtype), tuple(item.size), identities[key])
        else:
            keys[key] = KeyRecord("bytes", identity=identities[key])
    return keys, tuple(shared), load_index(metadata, keys)


def build_manifest(
    metadata: Metadata,
    files: dict[str, FileRecord],
    world_size: int,
    extra_info: dict | None = None,
    *,
    keys: ManifestKeys | None = None,
) -> Manifest:
    """The manifest of ``metadata`` and ``files``; ``keys``: :func:`manifest_keys` of ``metadata``, if known."""
    records, shared, index = manifest_keys(metadata) if keys is None else keys
    written = files.get(METADATA_NAME)  # the record of metadata's own bytes, as write_metadata wrote them
    return Manifest(
        world_size=world_size,
        keys=records,
        files=dict(files),
        extra_info=dict(extra_info or {}),
        shared=shared,
        keys_from_metadata_crc32=None if written is None else written.crc32,
        load_index=None if written is None else index,  # tied to the .metadata written: no pin, no index
    )


def commit_staged(
    path: str | os.PathLike,
    metadata: Metadata,
    files: dict[str, FileRecord],
    world_size: int,
    *,
    extra_info: dict | None = None,
    staged: PurePath | None = None,
    protocol: SaveProtocol | None = None,
    keys: ManifestKeys | None = None,
    written: Iterable[str] = (),
) -> None:
    """Prune stray files from the staging dir, write the manifest, publish it at ``path`` (the commit point:
    the swap by renames, or the head of the object-store protocol). ``keys``: :func:`manifest_keys` of
    ``metadata``, if known. ``written``: what this save wrote there besides ``files`` (a scale-mode save's
    rank records): where the protocol made the staging directory afresh, those are all the strays there can
    be, removed without listing it (one request less per save on an object store).

    Precondition: ``.metadata`` (written by :func:`~checkpoint.dcp_metadata.write_metadata`, whose
    record ``files`` holds) and every file in ``files`` are durable in the staging directory ``staged``
    (default: the rename protocol's, :func:`~checkpoint.atomic.staging_path`).
    """
    staged = staging_path(path) if staged is None else staged
    referenced = {info.relative_path for info in (metadata.storage_data or {}).values()} | {METADATA_NAME}
    keep = {name: rec for name, rec in files.items() if name in referenced}
    assert METADATA_NAME in keep, "write_metadata's record must be among the files committed"
    store = storage_for(staged)
    fresh = protocol is not None and protocol.fresh_staging
    for name in [*files, *written] if fresh else store.list(staged):
        if name not in keep and name not in (METADATA_NAME, MARKER_NAME):
            # Leftovers of an earlier, killed save (another world size) or per-rank files now merged.
            store.delete(staged / name, missing_ok=fresh)
    write_manifest(staged, build_manifest(metadata, keep, world_size, extra_info, keys=keys))
    if protocol is None:
        swap_into_place(staged, path)
    else:
        protocol.publish(staged)
    logger.info("committed checkpoint %s (%d files, %d keys)", path, len(keep), len(metadata.state_dict_metadata))
