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

import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from checkpoint.durable import durable_write

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "FileRecord",
    "KeyRecord",
    "Manifest",
    "NotACheckpointError",
    "checksum_file",
    "dtype_name",
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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how the manifest spells a dtype."""
    return str(dtype).removeprefix("torch.")


class NotACheckpointError(ValueError):
    """A directory exists but holds no committed checkpoint (no manifest)."""


@dataclass(frozen=True)
class FileRecord:
    size: int
    """bytes"""
    crc32: int
    """zlib.crc32 of the whole file"""


@dataclass(frozen=True)
class KeyRecord:
    kind: str
    """"tensor" or "bytes" (a pickled non-tensor value, e.g. an ``extra`` entry)"""
    dtype: str | None = None
    """torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``; tensors only"""
    shape: tuple[int, ...] | None = None
    """the true global shape; tensors only"""

    def __post_init__(self) -> None:
        if self.kind not in ("tensor", "bytes"):
            raise ValueError(f"KeyRecord.kind must be 'tensor' or 'bytes', got {self.kind!r}")
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))


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

    def to_json(self) -> str:
        data = asdict(self)
        data["keys"] = {k: _drop_none(asdict(v)) for k, v in sorted(self.keys.items())}
        data["files"] = {k: asdict(v) for k, v in sorted(self.files.items())}
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> Manifest:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT_NAME:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT_NAME!r}")
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(
                    f"format version {data.get('version')!r} is not supported by this release "
                    f"(it reads version {FORMAT_VERSION}); upgrade offload-fsdp"
                )
            return cls(
                world_size=int(data["world_size"]),
                keys={k: KeyRecord(**v) for k, v in data["keys"].items()},
                files={k: FileRecord(**v) for k, v in data["files"].items()},
                format=data["format"],
                version=data["version"],
                extra_info=dict(data.get("extra_info", {})),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{source} is not a valid {FORMAT_NAME} manifest: {exc!r}") from exc


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def checksum_file(path: str | os.PathLike) -> FileRecord:
    """Size and CRC-32 of a file, read in bounded pieces."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileRecord(size=size, crc32=crc)


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Write ``manifest.json`` durably: temp file, fsync, rename, fsync the directory.

    This is the commit point of a save: call it after every other file is on disk.
    """
    durable_write(Path(directory) / MANIFEST_NAME, manifest.to_json(), sync_dir=True)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate the manifest of checkpoint ``directory``.

    Raises ``FileNotFoundError`` when the path does not exist and
    :class:`NotACheckpointError` when it exists but was never committed.
    """
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"checkpoint path {str(directory)!r} does not exist")
    if not directory.is_dir():
        raise NotACheckpointError(f"{str(directory)!r} is a file, not a checkpoint directory")
    path = directory / MANIFEST_NAME
    if not path.exists():
        raise NotACheckpointError(
            f"{str(directory)!r} has no {MANIFEST_NAME}: it is not a committed {FORMAT_NAME} "
            "checkpoint (a save that did not finish, or a plain DCP directory); "
            "re-save it, or read it with torch.distributed.checkpoint directly"
        )
    return Manifest.from_json(path.read_text(), source=str(path))


def verify_files(directory: str | os.PathLike, manifest: Manifest, *, checksums: bool = True) -> list[str]:
    """Every problem with the files of a checkpoint, one sentence each; empty when all match."""
    directory = Path(directory)
    problems = []
    for name, record in sorted(manifest.files.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"{path}: missing (the manifest lists it with {record.size} bytes)")
            continue
        size = path.stat().st_size
        if size != record.size:
            problems.append(f"{path}: {size} bytes, the manifest says {record.size} (truncated or overwritten)")
        elif checksums and checksum_file(path).crc32 != record.crc32:
            problems.append(f"{path}: CRC-32 does not match the manifest (the file is corrupt)")
    return problems
