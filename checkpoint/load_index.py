"""The manifest's load index: what a load reads instead of unpickling ``.metadata``.

Unpickling DCP's ``.metadata`` through the restricted unpickler and checking it
costs more than the reads of a checkpoint of many small tensors (~40% of a
30,000-parameter load). Where every key is stored as one piece (a tensor as one
chunk covering it whole, a pickled value as one byte range: any single-process
save), a save writes where each piece lies into the manifest
(:class:`~checkpoint.manifest.LoadIndex`, :func:`load_index`), and a load
builds the few metadata records it needs from it (:class:`IndexedKeys`).

Trusted only when it checks out: its CRC-32 over the columns and the key
records (a flipped digit anywhere is a mismatch), the pin
(:attr:`~checkpoint.manifest.Manifest.keys_from_metadata_crc32`) equal to the
CRC-32 of ``.metadata`` as read (so the index was made from the very
``.metadata`` the manifest vouches for: one rewritten after the save is not
indexed), and every piece inside a listed data file, no two sharing bytes but
for an equal pickled value stored once. Anything else (:func:`indexed_keys`
returns ``None``) and the load reads ``.metadata`` as before.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Iterable, Mapping

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint.data_file import StorageInfo
from checkpoint.manifest import METADATA_NAME, KeyRecord, LoadIndex, Manifest, SharedValues
from checkpoint.training_state import key_path

__all__ = ["IndexedKeys", "index_problems", "indexed_keys", "load_index"]

_BYTES = BytesStorageMetadata()  # a field-less marker; one instance serves every byte key


def load_index(metadata: Metadata, keys: Mapping[str, KeyRecord]) -> LoadIndex | None:
    """The load index of ``metadata`` for a manifest recording ``keys`` (its :attr:`~Manifest.keys`: every key
    but those listed as shared values), or ``None`` when a key is stored in several pieces (a sharded save),
    through a transform, or not at all."""
    where: dict[str, StorageInfo] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in keys:
            if index.fqn in where or info.transform_descriptors:
                return None
            where[index.fqn] = info
    items = metadata.state_dict_metadata
    if len(where) != len(keys) or not all(_one_piece(items[key]) for key in keys):
        return None
    ordered = sorted(keys)  # the order Manifest.to_json writes them in, and a load parses them in
    files = sorted({where[key].relative_path for key in ordered})
    number = {name: i for i, name in enumerate(files)}
    paths = metadata.planner_data or {}
    index = LoadIndex(
        files=tuple(files),
        file=tuple(number[where[key].relative_path] for key in ordered),
        offset=tuple(where[key].offset for key in ordered),
        length=tuple(where[key].length for key in ordered),
        paths={key: list(path) for key in ordered if (path := paths.get(key)) and tuple(path) != key_path(key)},
        crc32=0,
    )
    return dataclasses.replace(index, crc32=index.digest({key: keys[key] for key in ordered}))


def index_problems(metadata: Metadata, manifest: Manifest) -> list[str]:
    """What in ``manifest``'s load index disagrees with ``metadata`` or with the key records, one phrase
    (``fsdp-ckpt verify``; a load does not trust such an index, and reads ``.metadata`` instead)."""
    index = manifest.load_index
    if index is None:
        return []
    if index.digest(manifest.keys) != index.crc32:
        return ["its load_index does not match its CRC-32 (manifest.json is damaged there)"]
    made = load_index(metadata, manifest.keys)
    if made is None:
        return ["its load_index lists keys that .metadata stores in several pieces"]
    columns = zip(manifest.keys, index.file, index.offset, index.length, made.file, made.offset, made.length)
    for key, *pieces in columns:
        if pieces[:3] != pieces[3:] or index.files[pieces[0]] != made.files[pieces[3]]:
            return [f"its load_index does not say where .metadata stores {key!r}"]
    if index.paths != made.paths:
        return ["its load_index does not record the nested paths .metadata does"]
    return []


def _one_piece(item: TensorStorageMetadata | BytesStorageMetadata) -> bool:
    if not isinstance(item, TensorStorageMetadata):
        return True
    return len(item.chunks) == 1 and not any(item.chunks[0].offsets) and item.chunks[0].sizes == item.size


class IndexedKeys:
    """A checkpoint's keys as its load index describes them: DCP's metadata records of each, built from the
    manifest (the index checked by :func:`indexed_keys`)."""

    def __init__(self, manifest: Manifest, saved: dict) -> None:
        assert manifest.load_index is not None
        self._manifest = manifest
        self._index = manifest.load_index
        self._position = dict(zip(manifest.keys, range(len(manifest.keys))))
        self.saved: dict[str, TensorStorageMetadata | BytesStorageMetadata] = saved
        """key -> its record, as ``.metadata``'s ``state_dict_metadata`` holds it (shared values included)"""

    @property
    def planner_paths(self) -> dict[str, tuple]:
        """DCP's ``planner_data`` for the keys whose nested path is not the one
        :func:`~checkpoint.training_state.key_path` derives from the name (the others are left out)."""
        return {key: tuple(path) for key, path in self._index.paths.items()}

    def stored_at(self, key: str) -> StorageInfo | None:
        """Where the one piece of ``key`` lies (a shared value: its source's), or ``None`` for no such key."""
        i = self._position.get(key)
        if i is None and key in self.saved:  # a shared value (few are read: a load reads their sources)
            i = self._position.get(self._sources[key])
        if i is None:
            return None
        index = self._index
        return StorageInfo(index.files[index.file[i]], index.offset[i], index.length[i])

    @functools.cached_property
    def _sources(self) -> dict[str, str]:
        """shared key -> its source key"""
        return {key: source for family in self._manifest.shared for key, source, _ in family.keys()}

    def metadata_of(self, keys: Iterable[str]) -> Metadata:
        """DCP ``Metadata`` of ``keys`` alone (each one the checkpoint holds), for a DCP read plan of them."""
        items: dict = {}
        storage: dict[MetadataIndex, StorageInfo] = {}
        for key in keys:
            item = items[key] = self.saved[key]
            offsets = torch.Size([0] * len(item.size)) if isinstance(item, TensorStorageMetadata) else None
            where = self.stored_at(key)
            assert where is not None, f"{key} is not in the checkpoint"
            storage[MetadataIndex(key, offsets)] = where
        return Metadata(state_dict_metadata=items, planner_data={}, storage_data=storage)


def indexed_keys(manifest: Manifest, metadata_crc32: int) -> IndexedKeys | None:
    """The keys of ``manifest`` as its load index describes them, when it checks out for a ``.metadata`` whose
    bytes have CRC-32 ``metadata_crc32`` (see the module's doc); ``None`` otherwise (no index, or one not to
    be trusted: the load reads ``.metadata``).

    Linear in the keys, each step a C loop (``map``, ``sorted``): a load of 30,000 parameters checks 120,000
    entries.
    """
    index = manifest.load_index
    if index is None or manifest.keys_from_metadata_crc32 != metadata_crc32:
        return None
    if not _well_typed(index, manifest) or index.digest(manifest.keys) != index.crc32:
        return None
    if not _inside_files(index, manifest):
        return None
    saved = _records(manifest.keys)
    if saved is None:
        return None
    count, names = len(saved), []
    for family in manifest.shared:
        if any(saved.get(source) is not _BYTES for source in family.fields.values()):
            return None  # read from something other than a pickled value of its own
        names += _shared_names(family)
    saved.update(zip(names, itertools.repeat(_BYTES)))
    if len(saved) != count + len(names):
        return None  # a key listed twice
    return IndexedKeys(manifest, saved)


def _shared_names(family: SharedValues) -> list[str]:
    """Every key ``family`` lists (:meth:`~checkpoint.manifest.SharedValues.keys`), names only, each one
    concatenation (~330,000 keys at 30,000 parameters: paths and joins per key took twice as long)."""
    under = ".".join((*family.under, ""))
    heads = [f"{under}{name}." for name in family.names]
    return [head + field for field in family.fields for head in heads]


def _ints(column: tuple, low: int, high: int | None = None) -> bool:
    """Whether ``column`` holds plain ints (no bools, no floats) from ``low`` to below ``high``."""
    if not column:
        return True
    return set(map(type, column)) == {int} and min(column) >= low and (high is None or max(column) < high)


def _well_typed(index: LoadIndex, manifest: Manifest) -> bool:
    """Whether every entry is a plain number within range and every file one the manifest lists (but ``.metadata``)."""
    return (
        len(index.file) == len(index.offset) == len(index.length) == len(manifest.keys)
        and all(name in manifest.files and name != METADATA_NAME for name in index.files)
        and _ints(index.file, 0, len(index.files))
        and _ints(index.offset, 0)
        and _ints(index.length, 0)
        and all(type(p) in (str, int) for path in index.paths.values() for p in path)
    )


def _inside_files(index: LoadIndex, manifest: Manifest) -> bool:
    """Whether every piece lies within its file's recorded size and no two share bytes, but for equal pickled
    values stored once (one range, read by each of its keys)."""
    ends = list(map(operator.add, index.offset, index.length))
    sizes = [manifest.files[name].size for name in index.files]
    if not all(map(operator.le, ends, map(sizes.__getitem__, index.file))):
        return False
    # one number line: file i's bytes from i * span on, so one sort orders the pieces of every file
    span = max(sizes, default=0) + 1
    starts = [f * span + o for f, o in zip(index.file, index.offset)]
    order = sorted(range(len(starts)), key=starts.__getitem__)
    first = [starts[i] for i in order]
    last = [starts[i] + index.length[i] for i in order]
    if all(map(operator.le, last[:-1], first[1:])):
        return True
    kinds = [record.kind for record in manifest.keys.values()]
    for a, b in zip(order, order[1:]):
        if starts[a] + index.length[a] > starts[b]:
            same = (starts[a], index.length[a]) == (starts[b], index.length[b])
            if not (same and kinds[a] == kinds[b] == "bytes"):
                return False
    return True


def _records(keys: Mapping[str, KeyRecord]) -> dict | None:
    """DCP's record of each key, from the manifest's (one object per dtype and shape: a whole chunk's
    record is fixed by them); ``None`` when a record names no torch dtype."""
    tensors: dict[tuple[str | None, tuple[int, ...] | None], TensorStorageMetadata | BytesStorageMetadata] = {}
    saved: dict = {}
    for key, record in keys.items():
        if record.kind == "bytes":
            saved[key] = _BYTES
            continue
        kind = (record.dtype, record.shape)
        item = tensors.get(kind)
        if item is None:
            dtype = getattr(torch, record.dtype or "", None)
            if not isinstance(dtype, torch.dtype) or record.shape is None:
                return None
            size = torch.Size(record.shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
            item = tensors[kind] = TensorStorageMetadata(TensorProperties(dtype), size, [chunk])
        saved[key] = item
    return saved
