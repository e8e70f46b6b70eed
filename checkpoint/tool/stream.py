"""Read a checkpoint directory one tensor at a time, with bounded memory.

:class:`CheckpointReader` opens any DCP directory (``.metadata`` + ``*.distcp``):
an ``fsdp_dtensor`` checkpoint (with ``manifest.json``) or one written by plain
``torch.distributed.checkpoint.save`` (no manifest: manifest checks are skipped
and :attr:`CheckpointReader.note` says so). It never loads the whole
checkpoint: :meth:`CheckpointReader.read` assembles one key's full tensor from
its stored chunks through DCP's own public load path (``dcp.load`` with
``no_dist=True`` and a reader that reuses the already-parsed metadata), so the
peak is that tensor plus the largest chunk it is read from.

The same small :class:`Source` protocol is implemented by the import readers
(safetensors, torch files), so transforms and writers never care where tensors
come from.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from checkpoint.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    CheckpointCorruptError,
    Manifest,
)
from checkpoint.opener import open_checkpoint
from checkpoint.reader import DirectReader
from checkpoint.safe_unpickle import SafeLoadPlanner
from checkpoint.save_errors import first_failure
from checkpoint.storage_backend import locate, storage_for

__all__ = ["CheckpointReader", "Entry", "Source", "parse_dtype", "prefetch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """What is known about one stored key before reading it."""

    key: str
    kind: str
    """"tensor" or "object" (a pickled non-tensor value, e.g. a learning rate)"""
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    """stored pieces as (offsets, sizes); empty for sources that are not DCP directories"""

    @property
    def tensor_dtype(self) -> torch.dtype:
        """``dtype``, for a tensor entry (always set there)."""
        assert self.dtype is not None, f"{self.key}: not a tensor (kind {self.kind!r})"
        return self.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        if self.kind != "tensor":
            return 0
        return self.numel * self.tensor_dtype.itemsize


class Source(Protocol):
    """Anything the CLI converts from: a checkpoint directory, a safetensors set, a torch file."""

    entries: dict[str, Entry]

    def read(self, key: str) -> Any:
        """The full value of ``key`` (a tensor in its global shape, or a plain object)."""
        ...


_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def parse_dtype(name: str) -> torch.dtype:
    """A user-typed dtype (``bf16``, ``float32``, ``torch.float16``) as a floating ``torch.dtype``."""
    clean = _DTYPE_ALIASES.get(name.lower(), name.lower().removeprefix("torch."))
    dtype = getattr(torch, clean, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown floating dtype {name!r}; use one of bf16, fp16, fp32, fp64")
    return dtype


class CheckpointReader:
    """A DCP checkpoint directory opened for streaming reads.

    Raises ``FileNotFoundError`` when ``path`` does not exist and ``ValueError``
    when it is not a DCP directory or its manifest or ``.metadata`` is
    unreadable (:class:`~checkpoint.manifest.CheckpointCorruptError`). Opening
    reads only ``.metadata`` and ``manifest.json`` (see
    :func:`checkpoint.opener.open_checkpoint` for ``verify``); with the default
    ``verify="crc"``, :meth:`finish` checks the CRC-32 of every file read from.
    """

    def __init__(self, path: str | Path, *, verify: str = "crc") -> None:
        self.path = locate(path)  # a URL stays bound to its storage
        store = storage_for(self.path)
        found = store.stat(self.path, follow_symlinks=True)
        if found is None:
            raise FileNotFoundError(f"checkpoint path {str(self.path)!r} does not exist; check the path")
        if found.kind != "directory":
            raise ValueError(
                f"{str(self.path)!r} is a file, not a checkpoint directory; pass the directory that holds .metadata"
            )
        if store.stat(self.path / METADATA_NAME, follow_symlinks=True) is None:
            raise ValueError(
                f"{str(self.path)!r} has no {METADATA_NAME}: not a DCP checkpoint "
                "(an unfinished save, or the wrong directory); pass a directory written by "
                "checkpoint.save or torch.distributed.checkpoint.save"
            )
        # the one opener: manifest first (strictly checked), then .metadata through the restricted unpickler
        self.opened = open_checkpoint(self.path, verify=verify, require_manifest=False, quiet=True)
        self.manifest: Manifest | None = self.opened.manifest
        self.metadata: Metadata = self.opened.metadata
        self.note: str | None = None
        if self.manifest is None:
            self.note = (
                f"no {MANIFEST_NAME}: a plain DCP directory (or an uncommitted save); "
                "manifest checks (file sizes, checksums, commit) are skipped"
            )
        self._check = self.opened.content_check()
        self.entries: dict[str, Entry] = {
            key: _entry(key, md) for key, md in sorted(self.metadata.state_dict_metadata.items())
        }

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def world_size(self) -> int | None:
        """Ranks that wrote it: from the manifest, else the number of distinct data files."""
        if self.manifest is not None:
            return self.manifest.world_size
        return len(self.data_files()) or None

    def data_files(self) -> set[str]:
        """Names (relative to the directory) of every data file ``.metadata`` points into."""
        return {info.relative_path for info in (self.metadata.storage_data or {}).values()}

    def files_of(self, key: str) -> list[str]:
        """The data files holding ``key``'s chunks (for error messages)."""
        return sorted(
            {
                info.relative_path
                for index, info in (self.metadata.storage_data or {}).items()
                if isinstance(index, MetadataIndex) and index.fqn == key
            }
        )

    def read(self, key: str) -> Any:
        """``key``'s full value: a tensor in its global shape, or the stored object."""
        return self.read_many([key])[key]

    def read_many(self, keys: Iterable[str]) -> dict[str, Any]:
        """Several keys in one DCP load (one pass over the files they live in)."""
        keys = list(keys)
        state: dict[str, Any] = {}
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                raise KeyError(f"{key!r} is not in checkpoint {str(self.path)!r}")
            # Tensors are allocated at their global shape and filled in place;
            # a non-tensor placeholder is replaced by the unpickled object.
            state[key] = torch.empty(entry.shape, dtype=entry.dtype) if entry.kind == "tensor" else None
        with self.opened.reading():  # a save replacing the checkpoint meanwhile is said so, not called damage
            self._load_into(state, keys)
        return state

    def _load_into(self, state: dict[str, Any], keys: list[str]) -> None:
        try:
            with warnings.catch_warnings():
                # no_dist=True is deliberate: a reader process needs no process group
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(
                    state,
                    storage_reader=DirectReader(self.path, self.metadata, direct=self.committed, check=self._check),
                    planner=SafeLoadPlanner(where=str(self.path)),
                    no_dist=True,
                )
        except (Exception, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
            files = sorted({f for key in keys for f in self.files_of(key)})
            cause = first_failure(exc)
            if isinstance(cause, CheckpointCorruptError):
                raise cause from None  # names the file and the fix already
            raise ValueError(
                f"reading {_short(keys)} from {str(self.path)!r} failed (files {files}): "
                f"{_one_line(exc)}; run `fsdp-ckpt verify` on it, then restore or re-save the damaged file"
            ) from exc

    def finish(self) -> None:
        """Check the CRC-32 of every file read from so far (``verify="crc"``); raises naming a damaged file.

        Call it once the values read are used, before committing anything made
        from them; it reads only the bytes of those files no one read.
        """
        if self._check is not None:
            with self.opened.reading():
                self._check.finish()

    def batches(self, keys: Iterable[str], *, batch_bytes: int = 64 << 20) -> Iterator[list[str]]:
        """``keys`` in order, grouped into runs of about ``batch_bytes`` (a larger tensor alone)."""
        batch: list[str] = []
        size = 0
        for key in keys:
            nbytes = self.entries[key].nbytes
            if batch and size + nbytes > batch_bytes:
                yield batch
                batch, size = [], 0
            batch.append(key)
            size += nbytes
        if batch:
            yield batch

    def iter_values(self, keys: Iterable[str], *, batch_bytes: int = 64 << 20) -> Iterator[tuple[str, Any]]:
        """``(key, value)`` in order, reading small keys in batches of about ``batch_bytes``.

        Batching spares one DCP load per tiny tensor; memory stays bounded by
        ``max(batch_bytes, largest tensor)`` plus one stored chunk.
        """
        for batch in self.batches(keys, batch_bytes=batch_bytes):
            values = self.read_many(batch)
            for key in batch:
                yield key, values.pop(key)


def _entry(key: str, md: Any) -> Entry:
    if isinstance(md, TensorStorageMetadata):
        return Entry(
            key=key,
            kind="tensor",
            dtype=md.properties.dtype,
            shape=tuple(int(s) for s in md.size),
            chunks=tuple((tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in md.chunks),
        )
    if isinstance(md, BytesStorageMetadata):
        return Entry(key=key, kind="object")
    raise ValueError(f"key {key!r} has storage metadata of unknown type {type(md).__name__}; upgrade offload-fsdp")


def _short(keys: list[str]) -> str:
    return repr(keys[0]) if len(keys) == 1 else f"{len(keys)} keys ({keys[0]!r}, ...)"


def _one_line(exc: BaseException) -> str:
    exc = first_failure(exc)
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


class _Failure:
    """The producer thread's exception, carried to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


class _Handoff:
    """What :func:`prefetch`'s producer thread and its consumer share: one slot and a byte count."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.slot: queue.Queue = queue.Queue(maxsize=1)
        self.cond = threading.Condition()
        self.alive = 0
        """bytes of the items the producer has started on and the consumer not yet released"""
        self.stop = False

    def reserve(self, size: int) -> bool:
        """Wait until an item of ``size`` bytes fits beside what the consumer holds; False once stopped."""
        with self.cond:
            # reserve before reading: the item must fit beside what the consumer still holds
            self.cond.wait_for(lambda: self.stop or self.alive == 0 or self.alive + size <= self.limit_bytes)
            if self.stop:
                return False
            self.alive += size
            return True

    def release(self, size: int) -> None:
        with self.cond:
            self.alive -= size
            self.cond.notify_all()

    def put(self, value: Any) -> bool:
        # a consumer that stopped early never takes it: give up then instead of blocking forever
        while not self.stop:
            try:
                self.slot.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()

    def produce(self, items: Iterable[Any], sizes: Sequence[int]) -> None:
        """The producer thread: each item, once its bytes are reserved, then :data:`_DONE` (or the error)."""
        try:
            it = iter(items)
            for size in sizes:
                if not self.reserve(size) or not self.put((next(it), size)):
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self.put(_Failure(exc))
            return
        self.put(_DONE)


def prefetch(items: Iterable[Any], sizes: Sequence[int], *, limit_bytes: int) -> Iterator[Any]:
    """``items`` produced one step ahead on a background thread, with at most ``limit_bytes`` alive.

    Reading the next tensor (DCP: deserialise, copy) then overlaps writing the
    current one (memcpy into the page cache, writeback). ``sizes[k]`` is the
    size of item ``k``, known before it is read; it counts from the moment the
    producer starts on it until the consumer asks for the item after it. The
    producer waits rather than exceed ``limit_bytes``, except for an item
    alone (a tensor larger than the limit is still read, just not overlapped).
    """
    handoff = _Handoff(limit_bytes)
    thread = threading.Thread(target=handoff.produce, args=(items, sizes), name="fsdp-ckpt-prefetch", daemon=True)
    thread.start()
    held = 0
    try:
        while True:
            # done with the previous item: release it before waiting, or a producer
            # waiting for room would wait for us while we wait for it
            handoff.release(held)
            held = 0
            got = handoff.slot.get()
            if got is _DONE:
                return
            if isinstance(got, _Failure):
                raise got.exc
            item, held = got
            del got
            yield item
            del item
    finally:
        handoff.close()
