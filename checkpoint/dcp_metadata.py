"""DCP's ``.metadata``: the one place this library builds a ``Metadata`` by hand, and the one that writes it.

A collective save lets DCP build the ``Metadata`` (its planner's global plan)
and completes it with :func:`with_storage`; everything else assembles one
from where its chunks landed:
:func:`checkpoint.commit.merge_metadata` (the per-rank records of a scale-mode
save) and the tensor-major writer behind reshard / import. Both go through
:class:`MetadataBuilder`, and every writer (DCP's path in
:class:`checkpoint.storage.FsdpWriter` included) writes it with
:func:`write_metadata`.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from collections.abc import Container, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint.data_file import StorageInfo
from checkpoint.manifest import METADATA_NAME, SharedValues
from checkpoint.storage_backend import CrcStream, FileRecord, locate, storage_for

__all__ = [
    "BYTES_RECORD",
    "MetadataBuilder",
    "key_identities",
    "metadata_bytes",
    "shared_key_problems",
    "shared_values",
    "with_storage",
    "write_metadata",
]


BYTES_RECORD = BytesStorageMetadata()
"""DCP's record of a pickled value: a field-less marker, so one instance serves every byte key"""


class MetadataBuilder:
    """A DCP ``Metadata`` assembled key by key: tensors and their chunks, byte values, where each is stored.

    Keys keep the order they are first declared in. A chunk declared twice
    (same key and offsets: a replica) is kept once, as first declared.
    :meth:`build` refuses a chunk or value with no storage location.
    """

    def __init__(self) -> None:
        self._state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self._offsets: dict[str, set[torch.Size]] = {}
        self._storage: dict[MetadataIndex, StorageInfo] = {}
        self._paths: dict[str, tuple] = {}
        self._properties: dict[torch.dtype, TensorProperties] = {}  # one object per dtype, as DCP pickles it

    def tensor(self, key: str, dtype: torch.dtype, size: Iterable[int], *, source: str = "") -> None:
        """Declare tensor ``key`` (its global shape and dtype); ``ValueError`` if it was declared otherwise.

        ``source`` (e.g. ``"rank 3"``) names the writer in that error.
        """
        size = torch.Size(size)
        current = self._state.get(key)
        if current is None:
            properties = self._properties.setdefault(dtype, TensorProperties(dtype=dtype))
            self._state[key] = TensorStorageMetadata(properties, size, [])
            self._offsets[key] = set()
        elif not isinstance(current, TensorStorageMetadata) or current.size != size:
            raise ValueError(f"ranks disagree on key {key!r}: {source} has shape {tuple(size)}")
        elif current.properties.dtype != dtype:
            raise ValueError(
                f"ranks disagree on the dtype of {key!r}: {source} has {str(dtype).removeprefix('torch.')}"
            )

    def chunk(self, key: str, offsets: Iterable[int], sizes: Iterable[int], where: StorageInfo | None = None) -> None:
        """Add a chunk of tensor ``key`` (declared first); ``where`` may come later, through :meth:`storage`."""
        current = self._state[key]
        assert isinstance(current, TensorStorageMetadata), f"{key} was declared a byte value"
        offsets = torch.Size(offsets)
        if offsets in self._offsets[key]:
            return
        self._offsets[key].add(offsets)
        current.chunks.append(ChunkStorageMetadata(offsets, torch.Size(sizes)))
        if where is not None:
            self._storage[MetadataIndex(key, offsets)] = where

    def byte_value(self, key: str, where: StorageInfo | None = None) -> None:
        """Add a pickled non-tensor value (the first one declared for ``key`` is kept)."""
        if key in self._state:
            return
        self._state[key] = BYTES_RECORD  # shared: pickled once, referenced by every byte key
        if where is not None:
            self._storage[MetadataIndex(key)] = where

    def storage(self, where: Mapping[MetadataIndex, StorageInfo]) -> None:
        """Storage locations recorded elsewhere (another process's writes); a location already known wins."""
        for index, info in where.items():
            self._storage.setdefault(index, info)

    def path(self, key: str, path: Iterable[Any]) -> None:
        """``key``'s nested-dict path (DCP's ``planner_data``), from which a load rebuilds nested values."""
        self._paths.setdefault(key, tuple(path))

    def keys(self) -> list[str]:
        """The keys declared so far, in order."""
        return list(self._state)

    def build(self, *, require_storage: bool = True) -> Metadata:
        """The ``Metadata``; ``require_storage=False``: a skeleton whose storage comes later (:func:`with_storage`)."""
        if require_storage:
            missing = [
                f"{key}{'' if index.offset is None else list(index.offset)}"
                for key, index in self._indices()
                if index not in self._storage
            ]
            assert not missing, f"no storage location for {missing[:3]}"
        return Metadata(
            state_dict_metadata=self._state,
            planner_data=self._paths,
            storage_data=self._storage,
            storage_meta=None,  # DCP's default records a random save id and a path: saves would not be reproducible
            version=CURRENT_DCP_VERSION,
        )

    def _indices(self):
        for key, item in self._state.items():
            if isinstance(item, TensorStorageMetadata):
                for chunk in item.chunks:
                    yield key, MetadataIndex(key, chunk.offsets)
            else:
                yield key, MetadataIndex(key)


def with_storage(metadata: Metadata, storage: Mapping[MetadataIndex, StorageInfo]) -> Metadata:
    """Complete the ``Metadata`` DCP's planner built (a collective save) as ``FileSystemWriter.finish`` would:
    where every item is stored, the DCP version, and no ``storage_meta`` (see :meth:`MetadataBuilder.build`)."""
    metadata.storage_data = dict(storage)
    metadata.storage_meta = None
    metadata.version = CURRENT_DCP_VERSION
    return metadata


class _CompactPickler(pickle.Pickler):
    """Pickles DCP's per-item records as calls of their constructors on their fields.

    A dataclass instance pickles by default as an empty object plus a dict of field names to values
    (~30 bytes a record even when every string in it is a memo reference); ``MetadataIndex(fqn, offset)``
    and ``_StorageInfo(file, offset, length)`` as constructor calls take about half, and there are one or
    two per key (~0.4 KB a parameter with AdamW in torch's flattened layout). Plain ``pickle.load`` (DCP's
    reader) builds the very same objects, and :class:`~checkpoint.safe_unpickle.MetadataUnpickler` admits
    these calls as it admits the default form, then checks every field.
    """

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is MetadataIndex:
            # index is a lookup hint that takes no part in equality or hashing: not stored, as DCP stores None
            return (MetadataIndex, (obj.fqn,) if obj.offset is None else (obj.fqn, tuple(obj.offset)))
        if kind is StorageInfo and obj.transform_descriptors is None:
            return (StorageInfo, (obj.relative_path, obj.offset, obj.length))
        if kind is ChunkStorageMetadata:
            return (ChunkStorageMetadata, (obj.offsets, obj.sizes))
        return NotImplemented


def metadata_bytes(metadata: Metadata) -> bytes:
    """``metadata`` pickled as :func:`write_metadata` writes it (compact per-item records, see :class:`_CompactPickler`)."""
    buffer = io.BytesIO()
    _CompactPickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)
    return buffer.getvalue()


def write_metadata(directory: str | os.PathLike, metadata: Metadata | bytes) -> FileRecord:
    """Pickle ``metadata`` into ``directory/.metadata`` (:func:`metadata_bytes`), replaced whole and durably;
    its size and CRC-32.

    ``metadata`` may be given already pickled (a save that reuses the previous one's). The record is
    computed from the bytes as they are written, for the manifest.
    """
    record: list[FileRecord] = []
    data = metadata if isinstance(metadata, bytes) else metadata_bytes(metadata)

    def dump(f) -> None:
        stream = CrcStream(f, owns_raw=False)  # write_file fsyncs and closes f
        stream.write(data)
        stream.wait_for_hints()
        record.append(FileRecord(size=stream.size, crc32=stream.crc))

    storage_for(directory).write_file(locate(directory) / METADATA_NAME, dump)
    return record[0]


def key_identities(metadata: Metadata, skip: Container[str] = ()) -> dict[str, int]:
    """Every key's identity as ``metadata`` records it, one CRC-32 each (the manifest's ``KeyRecord.identity``),
    but for the keys in ``skip`` (those a manifest lists as :class:`~checkpoint.manifest.SharedValues`).

    It covers the key's name, kind, dtype, global shape and nested path (``planner_data``), every chunk's
    offsets and sizes, and every stored piece's file, byte offset and length; not their order, which
    means nothing to a load. Linear in the number of chunks: one pass over ``storage_data``, one over the keys.
    """
    stored: dict[str, list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in skip:
            continue
        at = "" if index.offset is None else ",".join(map(str, index.offset))
        stored.setdefault(index.fqn, []).append(f"{at}@{info.relative_path}:{info.offset}+{info.length}")
    paths = metadata.planner_data or {}
    identities = {}
    for key, item in metadata.state_dict_metadata.items():
        if key in skip:
            continue
        if isinstance(item, TensorStorageMetadata):
            shape = ",".join(map(str, item.size))
            kind = f"tensor|{item.properties.dtype}|{shape}"
            chunks = sorted(f"{','.join(map(str, c.offsets))}/{','.join(map(str, c.sizes))}" for c in item.chunks)
        else:
            kind, chunks = type(item).__name__, []
        # repr, not str: a path of ("0",) and one of (0,) nest differently
        text = "|".join([key, kind, repr(paths.get(key)), ";".join(chunks), ";".join(sorted(stored.get(key, ())))])
        identities[key] = zlib.crc32(text.encode("utf-8", "surrogatepass"))
    return identities


def shared_values(metadata: Metadata) -> list[SharedValues]:
    """The byte keys of ``metadata`` a manifest can list by the value they share (:class:`SharedValues`).

    Keys stored at one byte range (an equal value stored once: a param group's options, keyed per
    parameter) read the value of the range's first key in sorted order, their *source*, whose own
    record the manifest keeps; each other one is listed when its key is the dotted join of its nested
    path (as DCP flattens). Families group the names whose fields share the same sources.
    """
    by_range: dict[tuple[str, int, int], list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.offset is None:
            by_range.setdefault((info.relative_path, info.offset, info.length), []).append(index.fqn)
    paths = metadata.planner_data or {}
    fields_of: dict[tuple[tuple[str, ...], str], dict[str, str]] = {}
    for keys in by_range.values():
        if len(keys) < 2:
            continue
        source = min(keys)
        for key in keys:
            path = paths.get(key)
            if key != source and path is not None and _listable(key, path, metadata):
                fields_of.setdefault((tuple(path[:-2]), path[-2]), {})[path[-1]] = source
    families: dict[tuple, list[str]] = {}
    for (under, name), fields in fields_of.items():
        families.setdefault((under, tuple(sorted(fields.items()))), []).append(name)
    return [
        SharedValues(under, tuple(sorted(names)), dict(fields)) for (under, fields), names in sorted(families.items())
    ]


def _listable(key: str, path: Any, metadata: Metadata) -> bool:
    return (
        isinstance(path, tuple)
        and len(path) >= 2
        and all(type(p) is str for p in path)
        and ".".join(path) == key
        and isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata)
    )


def shared_key_problems(metadata: Metadata, shared: Mapping[str, tuple[str, tuple[str, ...]]]) -> list[str]:
    """What makes each key of ``shared`` (key -> its source key and nested path, as a manifest lists it:
    :class:`SharedValues`) not a byte value of ``metadata`` stored exactly where its source is, at that
    nested path; one phrase per such key. One pass over ``storage_data`` (a key per parameter and option)."""
    ranges = {
        index.fqn: (info.relative_path, info.offset, info.length)
        for index, info in (metadata.storage_data or {}).items()
        if index.offset is None
    }
    items, paths = metadata.state_dict_metadata, metadata.planner_data or {}
    problems = []
    for key, (source, path) in shared.items():
        where = ranges.get(key)
        if (
            where is None
            or where != ranges.get(source)
            or not isinstance(items.get(key), BytesStorageMetadata)
            or not isinstance(items.get(source), BytesStorageMetadata)
            or tuple(paths.get(key) or ()) != tuple(path)
        ):
            problems.append(
                f"{key!r} is not stored as manifest.json recorded it at save (the value of {source!r}, nested at "
                f"{list(path)}): its byte range or its nested name were changed"
            )
    return problems
