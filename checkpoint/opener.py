"""Opening a checkpoint for reading: the one place that reads ``manifest.json`` and ``.metadata``.

Every reader (``checkpoint.load``, ``load_state_dict``, the streaming
:class:`~checkpoint.tool.stream.CheckpointReader` behind every ``fsdp-ckpt``
command) opens through :func:`open_checkpoint`, in this order: the manifest
(strictly checked, :mod:`checkpoint.manifest`), the files it lists (regular
files of the recorded sizes), ``.metadata``'s CRC-32, and only then
``.metadata`` itself, through the restricted unpickler of
:mod:`checkpoint.safe_unpickle`; or, where the manifest's load index checks out
(:mod:`checkpoint.load_index`), the index instead, ``.metadata`` unpickled only
if something asks for it (:attr:`OpenCheckpoint.metadata`). The returned
:class:`OpenCheckpoint` hands readers a :class:`~checkpoint.content_check.ContentCheck`
that verifies the CRC-32 of every file as it is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from checkpoint.content_check import ContentCheck, crc32
from checkpoint.dcp_metadata import key_identities, shared_key_problems
from checkpoint.errors import LoadTargetError
from checkpoint.load_index import IndexedKeys, index_problems, indexed_keys
from checkpoint.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    CheckpointCorruptError,
    FileRecord,
    Manifest,
    checksum_file,
    dtype_name,
    read_capped,
    read_manifest,
    verify_files,
)
from checkpoint.object_commit import resolve_for_load
from checkpoint.planner import metadata_problems
from checkpoint.safe_unpickle import load_metadata
from checkpoint.save_errors import first_failure
from checkpoint.storage_backend import locate, storage_for

__all__ = [
    "VERIFY_MODES",
    "CheckpointCorruptError",
    "OpenCheckpoint",
    "consistency_problems",
    "file_problems",
    "open_checkpoint",
    "read_failure",
    "storage_problems",
    "unlisted_files",
]

logger = logging.getLogger(__name__)

VERIFY_MODES = ("none", "sizes", "crc", "full")
_MAX_METADATA_BYTES = 1 << 32


@dataclass
class OpenCheckpoint:
    """A checkpoint opened for reading: where it is, its manifest and DCP metadata."""

    path: Path
    manifest: Manifest | None
    """None for a plain DCP directory opened with ``require_manifest=False``"""
    verify: str = "crc"
    """the ``verify`` mode it was opened with"""
    stamp: Hashable | None = None
    """``manifest.json``'s :meth:`~checkpoint.storage_backend.Storage.version` when opened (local: device
    and inode): a save to the same path swaps in a new one"""
    index: IndexedKeys | None = None
    """the keys as the manifest's load index describes them, when it checked out (``.metadata`` is then not
    unpickled unless :attr:`metadata` is asked for)"""
    _metadata: Metadata | None = field(default=None, repr=False)
    _metadata_bytes: bytes | None = field(default=None, repr=False)
    """``.metadata`` as read (CRC-checked) at open, until :attr:`metadata` unpickles it"""

    @property
    def metadata(self) -> Metadata:
        """DCP's metadata, read through the restricted unpickler and checked as :func:`open_checkpoint`
        describes; opened through the load index, on first use (a :class:`CheckpointCorruptError` then)."""
        if self._metadata is None:
            assert self._metadata_bytes is not None, "opened with neither metadata nor its bytes"
            self._metadata = _checked_metadata(self.path, self._metadata_bytes, self.manifest, self.verify)
            self._metadata_bytes = None
        return self._metadata

    @property
    def saved(self) -> dict:
        """key -> its record, ``.metadata``'s ``state_dict_metadata`` (built from the load index when opened so)."""
        return self.index.saved if self.index is not None else self.metadata.state_dict_metadata

    @property
    def planner_paths(self) -> dict:
        """``.metadata``'s ``planner_data`` (nested path per key); through the load index, the keys whose
        path :func:`~checkpoint.training_state.key_path` derives from the name alone may be left out."""
        return self.index.planner_paths if self.index is not None else self.metadata.planner_data or {}

    def metadata_of(self, keys: Iterable[str]) -> Metadata:
        """DCP metadata holding at least ``keys`` (each one the checkpoint holds): for a DCP read plan of them."""
        return self.index.metadata_of(keys) if self.index is not None else self.metadata

    def content_check(self) -> ContentCheck | None:
        """A fresh streamed CRC-32 check for the bytes a reader reads, or ``None`` when not asked for / no manifest."""
        if self.manifest is None or self.verify != "crc":
            return None
        return ContentCheck(self.path, self.manifest.files, storage_for(self.path))

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Reads of this checkpoint's files: a failure because a save replaced it meanwhile says so.

        A save to the same path swaps a new directory in while this one is read
        (loads take no lock); its files then fail the CRC-32 / size checks of
        the manifest read at open, which would read as damage. Nothing is damaged:
        the caller should load again. Without the streamed check (``verify`` other
        than ``"crc"``) a read that raced a save may have mixed both: refused too.
        """
        try:
            yield
        except (ValueError, OSError) as exc:
            if not self._replaced():
                raise
            raise _replaced_error(self.path) from exc
        if self.verify != "crc" and self._replaced():
            raise _replaced_error(self.path)

    def _replaced(self) -> bool:
        return self.stamp is not None and _stamp(self.path) != self.stamp


def open_checkpoint(
    path: str | os.PathLike,
    *,
    verify: str = "crc",
    require_manifest: bool = True,
    quiet: bool = False,
    storage_options: dict | None = None,
) -> OpenCheckpoint:
    """Find, validate and read the metadata of the checkpoint at ``path`` (no communication).

    ``verify``: ``"crc"`` (default) checks every file's size and the CRC-32 of
    ``.metadata`` here, and the CRC-32 of every data file as a reader reads
    it (streamed with the read, see :meth:`OpenCheckpoint.content_check`);
    ``"full"`` checks every file's CRC-32 here, before anything is read (one
    extra pass); ``"sizes"`` only sizes and ``.metadata``'s CRC-32 (the
    opt-out: damaged data bytes then load silently); ``"none"`` checks no
    file, nor the consistency of ``.metadata`` (chunk cover, byte ranges, the
    manifest's keys) that every other mode checks. ``.metadata`` is always
    read with a restricted unpickler: nothing in a checkpoint runs code; where the manifest's load index checks
    out (:mod:`checkpoint.load_index`) it is not unpickled at all unless :attr:`OpenCheckpoint.metadata` is asked for. ``require_manifest=False`` also opens a plain
    DCP directory (``.metadata``, no manifest: e.g. written by ``dcp.save``),
    without file checks (logged unless ``quiet``). ``path`` may be a URL (``storage_options`` go to its
    fsspec file system). Raises ``FileNotFoundError``,
    :class:`~checkpoint.manifest.NotACheckpointError` or
    :class:`CheckpointCorruptError` naming the path / file.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    src = resolve_for_load(locate(path, storage_options))
    stamp = _stamp(src)  # before the manifest is read: a save swapping in meanwhile shows as a change
    try:
        manifest = None
        store = storage_for(src)
        # Anything at manifest.json (a FIFO, a directory, a dangling link too) is read as one, and refused
        # naming what it is: the checkpoint is not quietly taken for a plain DCP directory without file checks.
        if require_manifest or store.stat(src / METADATA_NAME) is None or store.stat(src / MANIFEST_NAME) is not None:
            manifest = read_manifest(src)
        elif not quiet:
            logger.warning("%s has no manifest: reading it as a plain DCP checkpoint, without file checks", src)
        if manifest is not None and verify != "none":
            _check_files(src, manifest, checksums=verify == "full")
        data = _read_metadata_bytes(src, manifest, verify)
        index = None if manifest is None else indexed_keys(manifest, crc32(data))
        metadata = None if index is not None else _checked_metadata(src, data, manifest, verify)
    except (ValueError, OSError) as exc:
        if stamp is not None and _stamp(src) != stamp:
            raise _replaced_error(src) from exc  # a save swapped a new checkpoint in while this one was opened
        raise
    return OpenCheckpoint(
        src,
        manifest,
        verify,
        stamp if manifest is not None else None,
        index,
        _metadata=metadata,
        _metadata_bytes=data if metadata is None else None,
    )


def _checked_metadata(src: Path, data: bytes, manifest: Manifest | None, verify: str) -> Metadata:
    """``.metadata``'s bytes ``data`` (CRC-checked) unpickled and checked against ``manifest`` (see
    :func:`open_checkpoint`); :class:`CheckpointCorruptError` naming it otherwise."""
    metadata = load_metadata(src / METADATA_NAME, data)
    if manifest is not None:
        unlisted = unlisted_files(metadata, manifest.files)
        if unlisted:
            raise CheckpointCorruptError(
                f"{src / METADATA_NAME}: points into {unlisted[:5]}, which manifest.json does not list; "
                "restore the checkpoint from a copy or re-save it"
            )
    # verify="none" skips these too: `fsdp-ckpt verify` opens so and lists every problem itself
    problems = consistency_problems(metadata, manifest, metadata_crc32=crc32(data)) if verify != "none" else []
    if problems:
        raise CheckpointCorruptError(
            f"{src / METADATA_NAME}: does not describe a whole checkpoint ({'; '.join(problems[:3])}); "
            "restore the checkpoint from a copy or re-save it"
        )
    return metadata


def consistency_problems(
    metadata: Metadata, manifest: Manifest | None, *, metadata_crc32: int | None = None
) -> list[str]:
    """What in a (CRC-valid) ``.metadata`` would make a load quietly wrong rather than fail, one phrase each.

    A chunk missing or out of bounds would leave part of the destination as it
    was; a byte range shared by two entries or past its file's recorded end, or
    a key whose dtype / shape differs from the manifest's, would read other bytes;
    a key whose identity (chunks, byte ranges, nested name) differs from the one the
    manifest recorded at save would read another key's bytes, or another part of its own.
    The one check behind both a load (:func:`open_checkpoint`) and ``fsdp-ckpt verify``.

    ``metadata_crc32``: the CRC-32 of the bytes ``metadata`` was read from. When it is the one the
    manifest's key records were made from (:attr:`~checkpoint.manifest.Manifest.keys_from_metadata_crc32`),
    they are not compared key by key: they describe this very ``.metadata`` (edited records alone change
    nothing a load reads). ``fsdp-ckpt verify`` leaves it out and compares every record, and the manifest's
    load index (:func:`~checkpoint.load_index.index_problems`).
    """
    problems = metadata_problems(metadata)
    if manifest is not None:
        pinned = metadata_crc32 is not None and manifest.keys_from_metadata_crc32 == metadata_crc32
        problems += ([] if pinned else _key_problems(metadata, manifest)) + storage_problems(metadata, manifest.files)
        if metadata_crc32 is None:  # verify: a load does not trust an index that disagrees, verify names it
            problems += index_problems(metadata, manifest)
    return problems


def storage_problems(metadata: Metadata, files: Mapping[str, FileRecord]) -> list[str]:
    """Byte ranges of ``metadata`` that ``files`` (name -> recorded size) cannot hold, one phrase each.

    A range in a file not listed, shared by two entries (but for equal pickled values stored once), or past
    its file's recorded end.
    Also what a commit checks before it vouches for a merged ``.metadata``.
    """
    problems = [f"points into {name}, which is not listed" for name in unlisted_files(metadata, files)[:5]]
    # Pickled values may share one exact range: a save stores an equal value once (a param group's
    # options, keyed per parameter) and points every key at it. Reading it twice reads the same value.
    # Such a range is kept once (the rest are checked against it here), so the sort below sees each range once.
    first: dict[tuple[str, int, int], MetadataIndex] = {}
    for index, info in (metadata.storage_data or {}).items():
        where = (info.relative_path, info.offset, info.offset + info.length)
        seen = first.setdefault(where, index)
        if seen is not index and (seen.offset is not None or index.offset is not None):
            problems.append(f"{_entry(seen)} and {_entry(index)} share bytes of {where[0]}")
    ranges = sorted((*where, index) for where, index in first.items())
    for (name, _, end, index), (next_name, next_start, _, next_index) in zip(ranges, ranges[1:]):
        if name == next_name and next_start < end:
            problems.append(f"{_entry(index)} and {_entry(next_index)} share bytes of {name}")
    for name, _, end, index in ranges:
        if name in files and end > files[name].size:
            problems.append(f"{_entry(index)} is stored past the end of {name} (byte {end})")
    return problems


def unlisted_files(metadata: Metadata, files: Mapping[str, FileRecord]) -> list[str]:
    """The files ``metadata`` points into that ``files`` does not list, sorted."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()} - set(files))


def _key_problems(metadata: Metadata, manifest: Manifest) -> list[str]:
    """Keys ``.metadata`` and the manifest disagree on: presence, kind / dtype / shape, identity."""
    shared = manifest.shared_keys()
    problems = shared_key_problems(metadata, shared)
    # manifests written before 2026-11 record no identities: nothing to compare, and nothing to compute
    with_identities = any(r.identity is not None for r in manifest.keys.values())
    identities = key_identities(metadata, skip=shared) if with_identities else {}
    names: dict[torch.dtype, str] = {}  # dtype_name per dtype, once: a few dtypes among tens of thousands of keys
    for key, item in metadata.state_dict_metadata.items():
        record = manifest.keys.get(key)
        if record is None and key in shared:
            continue
        saved: tuple[str, str | None, tuple[int, ...] | None]
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            name = names.get(dtype) or names.setdefault(dtype, dtype_name(dtype))
            saved = ("tensor", name, tuple(item.size))
        else:
            saved = _BYTES_RECORD
        if record is None or (record.kind, record.dtype, record.shape) != saved:
            problems.append(f"{key!r} is {saved} here but {record} in {MANIFEST_NAME}")
        elif identities and record.identity is None:
            problems.append(f"{key!r} has no identity in {MANIFEST_NAME}, unlike its other keys")
        elif record.identity is not None and identities[key] != record.identity:
            problems.append(
                f"{key!r} is not stored as {MANIFEST_NAME} recorded it at save (its chunks, their byte ranges, "
                "its dtype or its nested name were changed)"
            )
    extra = sorted((set(manifest.keys) | set(shared)) - set(metadata.state_dict_metadata))
    if extra:
        problems.append(f"{MANIFEST_NAME} lists keys {extra[:5]} it does not hold")
    return problems


_BYTES_RECORD = ("bytes", None, None)


def _entry(index: MetadataIndex) -> str:
    return repr(index.fqn) if index.offset is None else f"{index.fqn!r} chunk {list(index.offset)}"


def _replaced_error(path: Path) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {str(path)!r} was replaced by another save while it was being read "
        f"({MANIFEST_NAME} changed); its files are not damaged: load it again, once that save finished"
    )


def _stamp(src: Path) -> Hashable | None:
    return storage_for(src).version(src / MANIFEST_NAME)


def _check_files(src: Path, manifest: Manifest, *, checksums: bool) -> None:
    problems = file_problems(src, manifest, checksums=checksums, metadata_crc=False)
    if problems:
        raise CheckpointCorruptError(f"checkpoint {str(src)!r} is damaged: " + "; ".join(problems))


def file_problems(src: Path, manifest: Manifest, *, checksums: bool, metadata_crc: bool = True) -> list[str]:
    """Every problem with the files ``manifest`` lists, one sentence each: sizes, CRC-32s with ``checksums``,
    and ``.metadata``'s CRC-32 in any case unless ``metadata_crc=False`` (a load checks it as it reads it).

    The file check behind both a load (:func:`open_checkpoint`) and ``fsdp-ckpt verify``.
    """
    record = manifest.files.get(METADATA_NAME)
    if record is None:
        return [f"{src / MANIFEST_NAME} does not list {METADATA_NAME}; re-save the checkpoint"]
    problems = verify_files(src, manifest, checksums=checksums)
    metadata_reported = any(p.startswith(f"{src / METADATA_NAME}:") for p in problems)
    if metadata_crc and not checksums and not metadata_reported and checksum_file(src / METADATA_NAME) != record:
        problems.append(f"{src / METADATA_NAME}: CRC-32 does not match the manifest (the file is corrupt)")
    return problems


def _read_metadata_bytes(src: Path, manifest: Manifest | None, verify: str) -> bytes:
    """``.metadata``'s bytes, CRC-checked against the manifest (unless ``verify="none"``) before anything parses them."""
    path = src / METADATA_NAME
    try:
        data = read_capped(path, _MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete; restore it from a copy") from None
    if len(data) > _MAX_METADATA_BYTES:
        raise CheckpointCorruptError(f"{path}: larger than {_MAX_METADATA_BYTES} bytes, not DCP metadata")
    record = manifest.files.get(METADATA_NAME) if manifest is not None else None
    if verify != "none" and record is not None and (len(data) != record.size or crc32(data) != record.crc32):
        raise CheckpointCorruptError(
            f"{path}: CRC-32 does not match the manifest (the file is corrupt); "
            "restore it from a copy or re-save the checkpoint"
        )
    return data


def read_failure(exc: BaseException, where: Path) -> Exception:
    """What to raise for a failed read of checkpoint ``where``: our own errors as they are, anything else as
    :class:`CheckpointCorruptError` (an ``Exception``, never DCP's ``BaseException``).

    A :class:`~checkpoint.errors.LoadTargetError` (the values being loaded into are at fault, raised by the
    load planner) is never reported as damaged files."""
    cause = first_failure(exc)
    if isinstance(cause, (ValueError, OSError, LoadTargetError)):
        return cause  # raised by our reader / opener / planner: they name the file or key and the fix
    text = " ".join(str(cause).split())[:200]
    return CheckpointCorruptError(
        f"reading {str(where)!r} failed ({type(cause).__name__}: {text}); run `fsdp-ckpt verify {where}`, "
        "then restore the damaged file from a copy or re-save the checkpoint"
    )
