"""One tensor as a ``torch.save`` archive, written from its raw bytes.

DCP stores every chunk as the ``torch.save`` archive of one tensor, and plain
``dcp.load`` / ``dcp_to_torch_save`` read it with ``torch.load``. ``torch.save``
itself spends most of its time computing the zip CRC-32 of the data record
(a serial pass over every byte, before the bytes reach the file). This module
builds the same kind of archive around the tensor's bytes so the writer can
hand those bytes to the OS untouched while the CRC-32 is computed on another
thread (:class:`checkpoint.storage.FsdpWriter`).

The archive holds what ``torch.save`` writes for one contiguous CPU tensor
(``data.pkl`` with ``torch._utils._rebuild_tensor_v2`` and one storage,
``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0``,
``version``, ``.data/serialization_id``), stored (not compressed), the data
record aligned to 64 bytes from the archive start (the other records are not padded,
unlike ``torch.save``'s, and unlike this module's before 2026-11), sizes and CRCs in zip data
descriptors as ``torch.save`` does. ``torch.load(weights_only=True)`` accepts it.
The serialization id is derived from the data's CRC-32, so equal tensors give
byte-identical archives.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ArchiveLayout", "archive_layout", "plan_archive", "stored_layout"]

_ARCHIVE = "archive"
_ALIGN = 64
_FLAGS = 0x0808  # data descriptor follows each record (bit 3), UTF-8 names (bit 11)
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_U32 = struct.Struct("<I")
_ZEROS_CRC = zlib.crc32(b"0" * 20)
"""CRC-32 of the serialization id's first half (see :meth:`ArchiveLayout.tail`)"""
_MAX_PLAIN_ZIP = 0xFFFFFFFF - (1 << 20)
"""Beyond this (zip64 territory) the writer falls back to ``torch.save``."""

# --- the archive ---


class _StorageRef:
    """Stands for the tensor's storage in ``data.pkl``; pickled as a persistent id, like ``torch.save`` does."""

    def __init__(self, storage_type: type, numel: int) -> None:
        self.pid = ("storage", storage_type, "0", "cpu", numel)


class _TensorRef:
    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride: list[int] = []
        step = 1
        for size in reversed(self.shape):
            stride.append(step)
            step *= size
        args: tuple[Any, ...] = (self.storage, 0, self.shape, tuple(reversed(stride)), False, collections.OrderedDict())
        # the rebuild function torch.save's format names in data.pkl (private, fixed by the format): renamed
        # -> torch.load of older files breaks too
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _StorageRef) else None


def _data_pkl(dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> bytes | None:
    try:
        storage_type = getattr(
            torch, torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)._pickle_storage_type()
        )
    except (KeyError, AttributeError, RuntimeError):
        return None  # a dtype without a legacy storage class: torch.save knows better
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_TensorRef(_StorageRef(storage_type, numel), shape))
    return buf.getvalue()


@dataclass
class ArchiveLayout:
    """An archive split around the tensor bytes: ``head``, the data, then ``tail(data_crc)``."""

    head: bytes
    data_size: int
    _records: list[tuple[str, int, int, int]]
    """(name, local header offset, size, crc) of the records in ``head``; the data record's crc filled later"""
    _after: list[tuple[str, bytes]]
    padded: bool = False
    """every record's payload 64-byte aligned, as written before 2026-11 (only the data record's is now)"""

    @property
    def size(self) -> int:
        """The archive's length in bytes."""
        return len(self.head) + self.data_size + self.tail_size

    @functools.cached_property
    def tail_size(self) -> int:
        return len(self.tail(0))  # the CRC changes bytes, never lengths

    def data_crc(self, tail: bytes | bytearray) -> int:
        """The data CRC-32 recorded in a tail read back from a file."""
        return _DESCRIPTOR.unpack_from(tail)[1]

    def tail(self, data_crc: int) -> bytes:
        """Everything after the data: its descriptor, the small records, the central directory.

        The bytes that depend on ``data_crc`` are patched into a template built once per layout.
        """
        if self._tail_template is None:
            return self._build_tail(data_crc)
        template, patches = self._tail_template
        out = bytearray(template)
        digits = b"%020d" % data_crc  # the serialization id is 20 zeros and these digits
        id_crc = zlib.crc32(digits, _ZEROS_CRC)
        # one call per tensor: positions grouped by kind, fewest Python steps (2 CRCs, the id, 2 id CRCs)
        crc_at, id_at, id_crc_at = patches
        for pos in crc_at:
            _U32.pack_into(out, pos, data_crc)
        out[id_at + 20 : id_at + 40] = digits
        for pos in id_crc_at:
            _U32.pack_into(out, pos, id_crc)
        return bytes(out)

    @functools.cached_property
    def _tail_template(self) -> tuple[bytes, tuple[list[int], int, list[int]]] | None:
        """:meth:`tail` for a sentinel CRC, and where the data's CRC, the serialization id and its CRC sit in it
        (``None`` in the unlikely case the sentinel's bytes also occur elsewhere: then built each time)."""
        sentinel = 0x9E3779B9  # any value: only its positions are used, found by building the tail around it
        built = self._build_tail(sentinel)
        serialization_id = f"{0:020d}{sentinel:020d}".encode()
        id_crc = zlib.crc32(serialization_id)
        patches: list[tuple[str, int]] = []
        for kind, needle in (
            ("data_crc", struct.pack("<I", sentinel)),
            ("id", serialization_id),
            ("id_crc", struct.pack("<I", id_crc)),
        ):
            pos = built.find(needle)
            while pos != -1:
                patches.append((kind, pos))
                pos = built.find(needle, pos + 1)
        # the data CRC sits in its descriptor and directory entry, the id once, its CRC in its descriptor and entry
        at = {kind: [pos for k, pos in patches if k == kind] for kind in ("data_crc", "id", "id_crc")}
        if tuple(len(v) for v in at.values()) != (2, 1, 2):
            return None
        return built, (at["data_crc"], at["id"][0], at["id_crc"])

    def _build_tail(self, data_crc: int) -> bytes:
        out = bytearray(_DESCRIPTOR.pack(0x08074B50, data_crc, self.data_size, self.data_size))
        records = list(self._records)
        name, offset, size, _ = records[-1]
        records[-1] = (name, offset, size, data_crc)
        pos = len(self.head) + self.data_size + len(out)
        after = list(self._after)
        after.append((f"{_ARCHIVE}/.data/serialization_id", f"{0:020d}{data_crc:020d}".encode()))
        for name, payload in after:
            record, crc = _record(name, payload, pos, padded=self.padded)
            records.append((name, pos, len(payload), crc))
            out += record
            pos += len(record)
        central_start = pos
        for name, offset, size, crc in records:
            encoded = name.encode()
            out += _CENTRAL.pack(
                0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(encoded), 0, 0, 0, 0, 0, offset
            )
            out += encoded
        central_size = len(out) - (central_start - len(self.head) - self.data_size)
        out += _EOCD.pack(0x06054B50, 0, 0, len(records), len(records), central_size, central_start, 0)
        return bytes(out)


def _local_header(name: str, pos: int, *, aligned: bool) -> bytes:
    """A local file header; ``aligned``: its payload starts 64-byte aligned from the archive start (torch's
    "FB" padding extra field)."""
    encoded = name.encode()
    extra = b""
    if aligned:
        pad = (-(pos + _LOCAL.size + len(encoded) + 4)) % _ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    return _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), len(extra)) + encoded + extra


def _record(name: str, payload: bytes, pos: int, *, padded: bool) -> tuple[bytes, int]:
    """A small record; unpadded unless ``padded``: ``torch.load`` reads it whole with ``get_record``, so only
    the data record needs torch's alignment (for ``mmap=True`` loads); padding every record cost ~300 B a chunk."""
    crc = zlib.crc32(payload)
    header = _local_header(name, pos, aligned=padded)
    return header + payload + _DESCRIPTOR.pack(0x08074B50, crc, len(payload), len(payload)), crc


def plan_archive(tensor: torch.Tensor) -> ArchiveLayout | None:
    """The archive around ``tensor``'s bytes, or ``None`` when ``torch.save`` must write it.

    Precondition: ``tensor`` is a contiguous CPU tensor (its bytes in row-major
    order are what goes between ``head`` and ``tail``). ``None`` for tensors
    beyond the plain-zip size limit, non-strided layouts, subclasses, and
    dtypes without a legacy storage class.
    """
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return None
    return archive_layout(tensor.dtype, tuple(tensor.shape))


def stored_layout(dtype: torch.dtype, shape: tuple[int, ...], length: int) -> ArchiveLayout | None:
    """The layout of a stored archive of ``length`` bytes for ``dtype`` and ``shape``, if this module writes
    or wrote (before 2026-11, every record padded) one of that length; ``None`` otherwise (another writer's)."""
    for padded in (False, True):
        layout = archive_layout(dtype, shape, padded=padded)
        if layout is None or layout.size == length:
            return layout
    return None


@functools.lru_cache(maxsize=4096)
def archive_layout(dtype: torch.dtype, shape: tuple[int, ...], *, padded: bool = False) -> ArchiveLayout | None:
    """The archive this module writes for a tensor of ``dtype`` and ``shape`` (``None``: not one it writes);
    ``padded``: the one it wrote before 2026-11, each record's payload aligned (see :class:`ArchiveLayout`).

    A reader uses it to find the data of an archive it recognises byte for byte
    without parsing the zip directory first. Cached: thousands of tensors share a few shapes, and the
    layout (never modified by its users) costs a pickle and a dozen zip records to build.
    """
    if sys.byteorder != "little":
        return None
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes > _MAX_PLAIN_ZIP:
        return None
    pkl = _data_pkl(dtype, shape, numel)
    if pkl is None:
        return None
    head = bytearray()
    records = []
    for name, payload in (
        ("data.pkl", pkl),
        (".format_version", b"1"),
        (".storage_alignment", str(_ALIGN).encode()),
        ("byteorder", b"little"),
    ):
        full = f"{_ARCHIVE}/{name}"
        record, crc = _record(full, payload, len(head), padded=padded)
        records.append((full, len(head), len(payload), crc))
        head += record
    data_name = f"{_ARCHIVE}/data/0"
    records.append((data_name, len(head), nbytes, 0))
    head += _local_header(data_name, len(head), aligned=True)
    return ArchiveLayout(bytes(head), nbytes, records, [(f"{_ARCHIVE}/version", b"3\n")], padded)
