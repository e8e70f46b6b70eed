"""The checkpoint manifest: the commit record of an ``fsdp_dtensor`` checkpoint.

A checkpoint directory is a plain DCP directory (``.metadata`` + ``*.distcp``)
plus ``manifest.json``, written last. The manifest is what makes a directory a
checkpoint: it records the format version, the world size that wrote it, every
key with its dtype and global shape, and the size and CRC-32 of every file, so
a reader can tell a complete checkpoint from a half-written or damaged one.

It holds no timestamps or host names: the same state saved twice gives the
same bytes.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import BinaryIO

import torch

from checkpoint.content_check import crc32
from checkpoint.errors import CheckpointCorruptError, NotACheckpointError
from checkpoint.storage_backend import FileRecord, locate, storage_for

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "CheckpointCorruptError",
    "FileRecord",
    "KeyRecord",
    "LoadIndex",
    "Manifest",
    "NotACheckpointError",
    "SharedValues",
    "check_relative_name",
    "checksum_file",
    "dtype_name",
    "read_capped",
    "open_regular",
    "read_manifest",
    "verify_files",
    "write_manifest",
]

FORMAT_NAME = "fsdp_dtensor"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
"""DCP's own metadata file (fixed by ``FileSystemWriter``)"""
_CHUNK_BYTES = 16 << 20
_MAX_MANIFEST_BYTES = 1 << 30
_MAX_WORLD_SIZE = 1 << 24
_MAX_FILE_BYTES = 1 << 50


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how the manifest spells a dtype."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KeyRecord:
    kind: str
    """"tensor" or "bytes" (a pickled non-tensor value, e.g. an ``extra`` entry)"""
    dtype: str | None = None
    """torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``; tensors only"""
    shape: tuple[int, ...] | None = None
    """the true global shape; tensors only"""
    identity: int | None = None
    """CRC-32 of everything ``.metadata`` says about the key (:func:`checkpoint.dcp_metadata.key_identities`):
    kind, dtype, shape, nested path, and every chunk's offsets, sizes, file and byte range. With the files'
    CRC-32s it pins which bytes the key is read from, so a relabelling in a CRC-valid ``.metadata`` is a
    mismatch naming the key. ``None`` in manifests written before 2026-11 (not checked then)"""

    def __post_init__(self) -> None:
        if self.kind not in ("tensor", "bytes"):
            raise ValueError(f"KeyRecord.kind must be 'tensor' or 'bytes', got {self.kind!r}")
        if self.shape is not None:  # map, not a generator: one C loop (a manifest holds tens of thousands)
            object.__setattr__(self, "shape", tuple(map(int, self.shape)))


@dataclass(frozen=True)
class SharedValues:
    """Byte keys that read one stored value each, listed once instead of key by key.

    For every ``name`` and every ``field``: key ``<under>.<name>.<field>`` (DCP's dotted flattening of
    its nested path ``(*under, name, field)``) is a pickled value stored exactly where key
    ``fields[field]`` is (the same file and byte range). What torch's flattened optimizer layout
    (``flatten_optimizer_state_dict=True``) makes of a param group: its options keyed once per
    parameter, one value each. A load checks each such key against its source key, whose identity the
    manifest pins (:func:`checkpoint.opener.consistency_problems`), as strictly as a key of its own.
    """

    under: tuple[str, ...]
    """the path above the names, e.g. ``("optimizer", "param_groups")``"""
    names: tuple[str, ...]
    """e.g. the parameters' FQNs"""
    fields: dict[str, str]
    """field (e.g. ``lr``) -> the key whose stored value every name's key of that field reads"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "under", tuple(self.under))
        object.__setattr__(self, "names", tuple(self.names))

    def keys(self) -> Iterator[tuple[str, str, tuple[str, ...]]]:
        """``(key, source key, nested path)`` of every key listed (made on the first call, then kept: a load
        goes over them once per read of the family's keys, ~330,000 at 30,000 parameters)."""
        return iter(self._listed)

    @functools.cached_property  # sets the instance's __dict__ directly: works on a frozen dataclass
    def _listed(self) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        return tuple(
            (".".join(path), source, path)
            for name in self.names
            for field_name, source in self.fields.items()
            for path in [(*self.under, name, field_name)]
        )


@dataclass(frozen=True)
class LoadIndex:
    """Where the bytes of every key of a manifest's :attr:`~Manifest.keys` lie, in columns (one entry per key,
    in the order of ``keys``): what a load reads instead of unpickling ``.metadata`` (:mod:`checkpoint.load_index`).

    Written only when every key is stored as one piece: a tensor as one chunk covering it whole, a pickled
    value as one byte range. :attr:`crc32` covers the columns and the key records they describe (name, kind,
    dtype, shape), so a flipped digit in either is a mismatch: the load then reads ``.metadata`` as before.
    """

    files: tuple[str, ...]
    """the data files the keys are stored in; :attr:`file` numbers them by position"""
    file: tuple[int, ...]
    """per key: the number of its file in :attr:`files`"""
    offset: tuple[int, ...]
    """per key: the byte its piece starts at in that file"""
    length: tuple[int, ...]
    """per key: the length of its piece in bytes"""
    paths: dict[str, list[str | int]]
    """the nested path (DCP's ``planner_data``) of each key whose path is not the one
    :func:`checkpoint.training_state.key_path` derives from its name"""
    crc32: int
    """:meth:`digest` of the index and the key records, as written"""

    def __post_init__(self) -> None:
        for name in ("files", "file", "offset", "length"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def digest(self, keys: dict[str, KeyRecord]) -> int:
        """CRC-32 of the canonical bytes of this index's columns with the records of ``keys`` (in order): each
        column joined or ``repr``'d whole (C loops; json's encoder took twice as long at 120,000 keys)."""
        records = keys.values()
        parts = [
            "\0".join(keys),
            "\0".join(map(str, map(_KIND, records))),
            "\0".join(map(str, map(_DTYPE, records))),
            repr(list(map(_SHAPE, records))),
            repr((self.files, self.file, self.offset, self.length, sorted(self.paths.items()))),
        ]
        crc = 0
        for part in parts:
            crc = crc32(part.encode("utf-8", "surrogatepass"), crc)
        return crc

    def to_json(self) -> dict[str, object]:
        """The manifest's ``load_index`` entry: one line per column, without spaces (a column per key)."""
        columns = {"file": self.file, "files": self.files, "length": self.length, "offset": self.offset}
        return {
            "crc32": self.crc32,
            "paths": _Json(_NO_SPACES.encode(dict(sorted(self.paths.items())))),
            **{name: _Json(_NO_SPACES.encode(column)) for name, column in columns.items()},
        }


@dataclass(frozen=True)
class Manifest:
    world_size: int
    """number of ranks that wrote the checkpoint"""
    keys: dict[str, KeyRecord]
    """every stored key (DCP's flattened names, e.g. ``model.layers.0.weight``)"""
    files: dict[str, FileRecord]
    """every file of the checkpoint but the manifest itself, by name relative to the directory"""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra_info: dict[str, object] = field(default_factory=dict)
    """free-form JSON-able facts a writer wants to record (e.g. the writer's options)"""
    shared: tuple[SharedValues, ...] = ()
    """byte keys listed by the value they share instead of in :attr:`keys` (absent before 2026-11)"""
    keys_from_metadata_crc32: int | None = None
    """the CRC-32 of the ``.metadata`` that :attr:`keys` and :attr:`shared` were recorded from at save (equal
    to ``files[".metadata"].crc32`` as written, but kept apart from it: a ``.metadata`` rewritten after the save
    with its file record recomputed no longer matches it). A load whose ``.metadata`` matches it skips
    comparing the records key by key (:func:`checkpoint.opener.consistency_problems`): they were made from
    those very bytes. ``None`` in manifests written before 2026-11 (every load compares them)"""
    load_index: LoadIndex | None = None
    """where every key's bytes lie, when each is stored as one piece (absent otherwise, and before 2026-11)"""

    def shared_keys(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """Every key of :attr:`shared`: key -> (its source key, its nested path)."""
        return {key: (source, path) for family in self.shared for key, source, path in family.keys()}

    def to_json(self) -> str:
        """Sorted keys, one line per key and per file (``json``'s C encoder for each; ``indent`` would
        switch to its pure-Python one, ~30 us a key), a trailing newline: the same bytes for the same state."""
        data = {
            "extra_info": self.extra_info,
            "files": {k: vars(v) for k, v in self.files.items()},
            "format": self.format,
            "keys": _encoded_keys(self.keys).text,
            "version": self.version,
            "world_size": self.world_size,
        }
        if self.shared:  # absent when empty: a manifest without shared values reads as before
            data["shared"] = [{"fields": f.fields, "names": list(f.names), "under": list(f.under)} for f in self.shared]
        if self.keys_from_metadata_crc32 is not None:
            data["keys_from_metadata_crc32"] = self.keys_from_metadata_crc32
        if self.load_index is not None:
            data["load_index"] = self.load_index.to_json()
        return _json_lines(data, depth=0) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> Manifest:
        """Parse and check a manifest strictly: every field's type and range, every file name.

        Raises :class:`CheckpointCorruptError` naming ``source`` for anything else
        (malformed JSON, absurd sizes, names that leave the directory, deep nesting).
        """
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge integers, deep nesting
            raise CheckpointCorruptError(f"{source} is not valid JSON ({_short(exc)}); {_FIX}") from None
        problem = _schema_problem(data)
        if problem is not None:
            raise CheckpointCorruptError(f"{source} is not a valid {FORMAT_NAME} manifest: {problem}; {_FIX}")
        if data["version"] != FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{source}: format version {data['version']!r} is not supported by this release "
                f"(it reads version {FORMAT_VERSION}); upgrade offload-fsdp"
            )
        return cls(
            world_size=data["world_size"],
            keys={k: _checked_record(v) for k, v in data["keys"].items()},
            files={k: FileRecord(**v) for k, v in data["files"].items()},
            format=data["format"],
            version=data["version"],
            extra_info=dict(data.get("extra_info", {})),
            shared=tuple(SharedValues(**f) for f in data.get("shared", ())),
            keys_from_metadata_crc32=data.get("keys_from_metadata_crc32"),
            load_index=None if "load_index" not in data else LoadIndex(**data["load_index"]),
        )


_FIX = "restore manifest.json from a copy or re-save the checkpoint"


def _checked_record(record: dict) -> KeyRecord:
    """The :class:`KeyRecord` of a record :func:`_key_problem` found nothing wrong with, its fields set as
    ``__init__`` would set them (``__post_init__``'s checks are the ones already made): a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, twice the cost of the record at 120,000 keys."""
    shape = record.get("shape")
    fields = {
        "kind": record["kind"],
        "dtype": record.get("dtype"),
        "shape": None if shape is None else tuple(shape),
        "identity": record.get("identity"),
    }
    parsed = object.__new__(KeyRecord)
    object.__setattr__(parsed, "__dict__", fields)
    return parsed


_LINES_UP_TO = 1000  # a section with more entries is written on one line: the C encoder does it whole
_COMPACT = json.JSONEncoder(
    sort_keys=True, separators=(", ", ": ")
)  # made once: json.dumps(**options) makes one a call
_NO_SPACES = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_KIND, _DTYPE, _SHAPE = (operator.attrgetter(name) for name in ("kind", "dtype", "shape"))


class _Json(str):
    """Text already encoded as JSON, placed as it is by :func:`_json_lines`."""


@dataclass(frozen=True)
class _EncodedKeys:
    keys: dict[str, KeyRecord]
    """a copy of the records encoded"""
    text: _Json
    """their JSON, as :meth:`Manifest.to_json` writes it"""
    problem: str | None
    """what :func:`read_manifest` would refuse in them, or ``None``"""


_NO_KEYS = _EncodedKeys({}, _Json("{}"), None)
_last_keys = _NO_KEYS


def _encoded_keys(keys: dict[str, KeyRecord]) -> _EncodedKeys:
    """``keys`` encoded and checked once: a collective save commits the same records save after save, and
    encoding, re-parsing and checking them was ~10% of a save of small tensors. Compared with the last
    ones first (the same record objects compare by identity, at C speed; equal records encode alike)."""
    global _last_keys
    if not keys:  # not kept: write_manifest checks the rest of a manifest without its keys
        return _NO_KEYS
    last = _last_keys
    if keys == last.keys:
        return last
    text = _Json(_json_lines({k: _drop_none(vars(v)) for k, v in keys.items()}, depth=1))
    problem = None
    for key, record in json.loads(text).items():
        problem = _key_problem(record)
        if problem is not None:
            problem = f"key {key[:200]!r}: {problem}"
            break
    _last_keys = _EncodedKeys(dict(keys), text, problem)  # one assignment: safe with saves in other threads
    return _last_keys


def _json_lines(value: object, *, depth: int) -> str:
    """``value`` as JSON with sorted keys: the top level one entry a line, then ``files`` one file a line
    and everything deeper (``keys``: one line, tens of thousands of entries) compact."""
    if isinstance(value, _Json):
        return value
    if not isinstance(value, dict) or depth >= 2 or not value or (depth == 1 and len(value) > _LINES_UP_TO):
        return _COMPACT.encode(value)
    pad = " " * (depth + 1)
    lines = ",\n".join(f"{pad}{json.dumps(k)}: {_json_lines(v, depth=depth + 1)}" for k, v in sorted(value.items()))
    return "{\n" + lines + "\n" + " " * depth + "}"


def _is_int(x: object, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _schema_problem(data: object) -> str | None:
    """What is wrong with parsed manifest JSON, one phrase, or ``None``."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    unknown = set(data) - {
        "format",
        "version",
        "world_size",
        "keys",
        "files",
        "extra_info",
        "shared",
        "keys_from_metadata_crc32",
        "load_index",
    }
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    if data.get("format") != FORMAT_NAME:
        return f"format is {str(data.get('format'))[:40]!r}, expected {FORMAT_NAME!r}"
    if not _is_int(data.get("version"), 0, 1 << 20):
        return "version is not a small integer"
    if not _is_int(data.get("world_size"), 1, _MAX_WORLD_SIZE):
        return f"world_size {str(data.get('world_size'))[:40]} is not an integer from 1 to {_MAX_WORLD_SIZE}"
    if not isinstance(data.get("extra_info", {}), dict):
        return "extra_info is not an object"
    if "keys_from_metadata_crc32" in data and not _is_int(data["keys_from_metadata_crc32"], 0, 0xFFFFFFFF):
        return "keys_from_metadata_crc32 is not a 32-bit unsigned integer"
    keys, files = data.get("keys"), data.get("files")
    if not isinstance(keys, dict) or not isinstance(files, dict):
        return "keys and files must be objects"
    for key, record in keys.items():
        problem = _key_problem(record)
        if problem is not None:
            return f"key {key[:200]!r}: {problem}"
    for name, record in files.items():
        problem = check_relative_name(name) or _file_problem(record)
        if problem is not None:
            return f"file {name[:200]!r}: {problem}"
    shared = data.get("shared", [])
    if not isinstance(shared, list):
        return "shared is not a list"
    for family in shared:
        problem = _shared_problem(family)
        if problem is not None:
            return f"shared: {problem}"
    if "load_index" in data:
        problem = _index_problem(data["load_index"], len(keys))
        if problem is not None:
            return f"load_index: {problem}"
    return None


_INDEX_FIELDS = frozenset({"crc32", "files", "file", "offset", "length", "paths"})


def _index_problem(index: object, count: int) -> str | None:
    """What makes ``index`` not the JSON of a :class:`LoadIndex` of ``count`` keys. Its values are not checked
    here: a load checks them against its CRC-32 and the files (:func:`checkpoint.load_index.indexed_keys`)."""
    if not isinstance(index, dict) or set(index) != _INDEX_FIELDS:
        return f"not an object of {', '.join(sorted(_INDEX_FIELDS))}"
    if not _is_int(index["crc32"], 0, 0xFFFFFFFF):
        return "crc32 is not a 32-bit unsigned integer"
    if not (isinstance(index["files"], list) and all(isinstance(name, str) for name in index["files"])):
        return "files is not a list of file names"
    if not all(
        isinstance(index[column], list) and len(index[column]) == count for column in ("file", "offset", "length")
    ):
        return "file, offset and length are not lists of one entry per key"
    if not (isinstance(index["paths"], dict) and all(isinstance(path, list) for path in index["paths"].values())):
        return "paths is not an object of lists"
    return None


def _shared_problem(family: object) -> str | None:
    def strings(x: object) -> bool:
        return isinstance(x, list) and all(isinstance(s, str) for s in x)

    if not isinstance(family, dict) or set(family) != {"under", "names", "fields"}:
        return "not a list of objects of under, names, fields"
    fields = family["fields"]
    if not (strings(family["under"]) and len(family["under"]) <= 64 and strings(family["names"])):
        return "under and names are not lists of strings"
    if not (isinstance(fields, dict) and all(isinstance(v, str) for v in fields.values())):
        return "fields is not an object of key names"
    return None


_KEY_FIELDS = frozenset({"kind", "dtype", "shape", "identity"})


def _key_problem(record: object) -> str | None:
    if not isinstance(record, dict) or not record.keys() <= _KEY_FIELDS:
        return "not an object of kind, dtype, shape, identity"
    if record.get("kind") not in ("tensor", "bytes"):
        return "kind is not 'tensor' or 'bytes'"
    if not isinstance(record.get("dtype", ""), (str, type(None))):
        return "dtype is not a string"
    shape = record.get("shape")
    if shape is not None and not (
        isinstance(shape, list) and len(shape) <= 64 and all(_is_int(s, 0, _MAX_FILE_BYTES) for s in shape)
    ):
        return "shape is not a list of non-negative integers"
    if "identity" in record and not _is_int(record["identity"], 0, 0xFFFFFFFF):
        return "identity is not a 32-bit unsigned integer"
    return None


def _file_problem(record: object) -> str | None:
    if not isinstance(record, dict) or set(record) != {"size", "crc32"}:
        return "not an object of size and crc32"
    if not _is_int(record["size"], 0, _MAX_FILE_BYTES):
        return f"size {str(record['size'])[:40]} is not a byte count from 0 to 2**50"
    if not _is_int(record["crc32"], 0, 0xFFFFFFFF):
        return "crc32 is not a 32-bit unsigned integer"
    return None


def check_relative_name(name: object) -> str | None:
    """Why ``name`` is not a plain file name inside a checkpoint directory, or ``None``.

    The format keeps every file directly in the directory: no separators, no
    ``..``, no absolute paths, so nothing named by a checkpoint is read from outside it.
    """
    if not isinstance(name, str) or not name:
        return "the file name is not a non-empty string"
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        return f"{name[:200]!r} is not a plain file name inside the checkpoint (no paths, no '..')"
    return None


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = False) -> BinaryIO:
    """Open ``path`` for reading, only if it is a regular file (never a FIFO, device or symlink).

    :meth:`~checkpoint.storage_backend.Storage.open_read` of the storage holding ``path``.
    """
    return storage_for(path).open_read(path, follow_symlinks=follow_symlinks)


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def checksum_file(path: str | os.PathLike) -> FileRecord:
    """Size and CRC-32 of a file, read in bounded pieces."""
    crc = 0
    size = 0
    with storage_for(path).open_read(path) as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = crc32(chunk, crc)
            size += len(chunk)
    return FileRecord(size=size, crc32=crc)


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Write ``manifest.json`` durably: temp file, fsync, rename, fsync the directory.

    This is the commit point of a save: call it after every other file is on disk. Raises ``ValueError``
    (nothing written) for a manifest :func:`read_manifest` would refuse, e.g. a file name with a path in it
    from a tampered rank record: a commit must not replace a checkpoint by one that cannot be loaded.
    """
    text = manifest.to_json()
    # the keys checked as they were encoded (once per set of records), everything else here
    problem = _encoded_keys(manifest.keys).problem or _schema_problem(
        json.loads(replace(manifest, keys={}, load_index=None).to_json())
    )
    if problem is None and manifest.load_index is not None:  # its columns have one entry per key
        problem = _index_problem(json.loads(_json_lines(manifest.load_index.to_json(), depth=1)), len(manifest.keys))
    if problem is not None:
        raise ValueError(f"refusing to commit {locate(directory) / MANIFEST_NAME}: {problem}; nothing was committed")
    storage_for(directory).write_file(locate(directory) / MANIFEST_NAME, text, sync_dir=True)


def read_capped(path: os.PathLike, limit: int) -> bytes:
    """The bytes of the plain file ``path``, or ``limit + 1`` of them when it holds more (the caller refuses it).

    Read in growing pieces (1 MiB, then doubling) until one comes back short: a file of a few bytes costs
    one read, with neither a buffer of the cap's size (GiBs) nor a size lookup first (on an object store a
    lookup is a request of its own: the object is opened once, by its GET).
    """
    pieces: list[bytes] = []
    total, want = 0, min(1 << 20, limit + 1)
    with storage_for(path).open_read(path) as f:
        while want:
            piece = f.read(want)
            pieces.append(piece)
            total += len(piece)
            if len(piece) < want:
                break
            want = min(2 * want, limit + 1 - total)
    return b"".join(pieces)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate the manifest of checkpoint ``directory``.

    Raises ``FileNotFoundError`` when the path does not exist and
    :class:`NotACheckpointError` when it exists but was never committed.
    """
    directory = locate(directory)
    path = directory / MANIFEST_NAME
    try:
        raw = read_capped(path, _MAX_MANIFEST_BYTES)  # the directory is looked at only when this fails
    except (FileNotFoundError, NotADirectoryError):
        found = storage_for(directory).stat(directory, follow_symlinks=True)
        if found is None:
            raise FileNotFoundError(f"checkpoint path {str(directory)!r} does not exist") from None
        if found.kind != "directory":
            raise NotACheckpointError(f"{str(directory)!r} is a file, not a checkpoint directory") from None
        raise NotACheckpointError(
            f"{str(directory)!r} has no {MANIFEST_NAME}: it is not a committed {FORMAT_NAME} "
            "checkpoint (a save that did not finish, or a plain DCP directory); "
            "re-save it, or read it with torch.distributed.checkpoint directly"
        ) from None
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{path} is larger than {_MAX_MANIFEST_BYTES} bytes: not a manifest; {_FIX}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"{path} is not UTF-8 text ({_short(exc)}); {_FIX}") from None
    return Manifest.from_json(text, source=str(path))


def verify_files(directory: str | os.PathLike, manifest: Manifest, *, checksums: bool = True) -> list[str]:
    """Every problem with the files of a checkpoint, one sentence each; empty when all match."""
    directory = locate(directory)
    store = storage_for(directory)
    problems = []
    for name, record in sorted(manifest.files.items()):
        path = directory / name
        found = store.stat(path)
        if found is None:
            problems.append(f"{path}: missing (the manifest lists it with {record.size} bytes)")
            continue
        if found.kind != "file":
            problems.append(f"{path}: {found.description}, not a regular file (a checkpoint holds only regular files)")
            continue
        size = found.size
        if size != record.size:
            problems.append(f"{path}: {size} bytes, the manifest says {record.size} (truncated or overwritten)")
        elif checksums and checksum_file(path).crc32 != record.crc32:
            problems.append(f"{path}: CRC-32 does not match the manifest (the file is corrupt)")
    return problems
