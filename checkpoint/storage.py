"""DCP storage writer for the ``fsdp_dtensor`` format: deterministic, checksummed, committed last.

:class:`FsdpWriter` subclasses DCP's ``FileSystemWriter`` (nothing in DCP is
patched) and overrides exactly these methods; ``reset``,
``prepare_global_plan`` (one file prefix per rank) and ``validate_checkpoint_id``
are DCP's own. The one private DCP name used here is ``_StoragePrefix`` (a
rank's file prefix in its plan); the storage record ``_StorageInfo`` comes from
:mod:`checkpoint.data_file`.

* ``storage_meta()`` returns ``None``: DCP's default records a random
  ``save_id`` and the (temporary) path in ``.metadata``, which would make two
  saves of the same state differ;
* ``set_up_storage_writer`` remembers whether this rank coordinates, and
  ``force_rank`` makes one process write as a given rank (scale mode);
* ``prepare_local_plan`` runs the coordinator's ``prepare()`` (the target
  checks and the marked staging directory, before any rank writes), removes a
  manifest a killed save left in the staging directory, and in scale mode
  names the rank's own file prefix; it makes no directory;
* ``write_data`` writes the rank's one file itself through
  :class:`~checkpoint.data_file.DataFile` (the one data-file writer, shared
  with reshard / import), in DCP's layout (same order, same write results,
  each chunk a ``torch.save`` archive so plain DCP reads it) but from the
  tensors' raw bytes: no ``torch.save`` serialisation pass, the CRC-32
  computed on a helper thread while the OS copies the bytes, writeback started
  right away, and, for an async save with bounded staging, each written item
  reported to its :class:`~checkpoint.staging.StagingGate`. The file's size
  and CRC-32 travel to the committing rank inside DCP's own write results;
* ``finish`` strips those records again and, in the default *collective*
  mode, writes ``.metadata`` with :func:`checkpoint.dcp_metadata.write_metadata`
  (as DCP's ``finish`` would, plus its size and CRC-32) and hands everything to
  ``on_commit`` (``manifest.json``, the commit record, then the swap into
  place, :mod:`checkpoint.commit`); in *scale* mode (``use_collectives=False``,
  or :func:`checkpoint.write_rank`) it writes, last, the rank's own record
  ``__<rank>.rank.json`` (its chunks, where they are stored, its files' sizes
  and CRC-32s, the save's id): plain integers and strings, much cheaper to read back than
  DCP's pickled per-rank metadata. :func:`checkpoint.commit.commit` merges them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

# _StoragePrefix: what FileSystemWriter puts in a SavePlan's storage_data (the rank's file prefix; no
# public name); renamed -> import fails, and scale-mode ranks can no longer name their own files
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint.data_file import DataFile, StorageInfo, data_file_name, write_tensor
from checkpoint.dcp_metadata import with_storage, write_metadata
from checkpoint.manifest import MANIFEST_NAME, METADATA_NAME, FileRecord, check_relative_name, dtype_name
from checkpoint.staging import StagedShard
from checkpoint.storage_backend import locate, storage_for

__all__ = [
    "RANK_RECORD_SUFFIX",
    "FsdpWriter",
    "quiet_single_process",
    "rank_record",
    "rank_record_name",
    "rank_record_problem",
    "write_items",
]

RANK_RECORD_SUFFIX = ".rank.json"
_FILE_RECORD_FQN = "__fsdp_dtensor_file_record__"


def rank_record_name(rank: int) -> str:
    return f"__{rank}{RANK_RECORD_SUFFIX}"


class FsdpWriter(FileSystemWriter):
    """Writes one staging directory; see the module docstring.

    ``on_commit(metadata, files)`` runs on the coordinator in collective mode
    after ``.metadata`` is on disk; ``prepare()`` runs on the coordinator in
    DCP's local-plan step, before any rank writes (its error reaches every
    rank); ``force_rank`` makes a single process write as that rank (scale
    mode, used by :func:`checkpoint.write_rank`), whose record carries ``save_id``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        on_commit=None,
        prepare=None,
        force_rank: int | None = None,
        world_size: int | None = None,
        save_id: str | None = None,
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.path = locate(path)  # DCP's init made a local Path of it; a URL's stays bound to its storage
        self._files: dict[str, FileRecord] = {}  # this rank's data files, for the manifest
        self.on_commit = on_commit
        self.prepare = prepare
        self.force_rank = force_rank
        self.world_size = world_size
        self._save_id = save_id  # not DCP's own save_id attribute: the caller's, for the rank record

    def storage_meta(self):
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator
        if self.force_rank is not None:
            self.rank = self.force_rank
            self.use_collectives = False

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # No mkdir here: the staging dir is made (marked) by whoever prepares the target, before any
        # rank writes; a rank creating it would leave an unmarked dir behind a refused save.
        if self.prepare is not None and self.is_coordinator:
            self.prepare()  # the coordinator's plan is gathered before any rank writes: it runs first
        if self.rank in (None, 0):
            # A manifest left in the staging dir by a killed save must not outlive this one's files.
            storage_for(self.path).delete(locate(self.path) / MANIFEST_NAME, missing_ok=True)
        if not self.use_collectives:
            # This rank's record from an earlier, uncommitted save must not vouch for the file rewritten now:
            # if this write fails or is killed, commit finds no record and names the rank.
            assert self.rank is not None  # set up by DCP (or force_rank) before any plan
            storage_for(self.path).delete(locate(self.path) / rank_record_name(self.rank), missing_ok=True)
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        results = self._write_rank_file(plan, planner)
        # File records ride along with DCP's write results to the committing rank.
        results += [
            WriteResult(index=MetadataIndex(f"{_FILE_RECORD_FQN}{name}"), size_in_bytes=rec.size, storage_data=rec)
            for name, rec in sorted(self._files.items())
        ]
        return _done(results)

    def _write_rank_file(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """This rank's one data file, laid out as DCP's writer lays it out, then fsync'd (:func:`write_items`)."""
        # An async save with bounded staging waits for each item to be in the OS's hands (checkpoint.staging).
        gates = {v.gate for v in getattr(planner, "state_dict", {}).values() if isinstance(v, StagedShard)}
        byte_items = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        items = [(wi.index, True) for wi in byte_items]
        items += [(wi.index, False) for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        by_index = {wi.index: wi for wi in plan.items}

        def resolve(index: MetadataIndex):
            data = planner.resolve_data(by_index[index])
            return data.getbuffer() if isinstance(data, io.BytesIO) else data  # what DCP resolves a byte item to

        where, record = write_items(self.path, data_file_name(plan.storage_data.prefix), items, resolve, gates=gates)
        self._files[record[0]] = record[1]
        return [WriteResult(index=index, size_in_bytes=w.length, storage_data=w) for (index, _), w in zip(items, where)]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, FileRecord] = {}
        clean: list[list[WriteResult]] = []
        for rank_results in results:
            kept = []
            for wr in rank_results:
                if wr.index.fqn.startswith(_FILE_RECORD_FQN):
                    files[wr.index.fqn[len(_FILE_RECORD_FQN) :]] = wr.storage_data
                else:
                    kept.append(wr)
            clean.append(kept)
        if not self.use_collectives:
            # Scale mode: this record, written after the rank's data is durable, is its "done" mark.
            record = rank_record(metadata, clean[0] if clean else [], files)
            record["world_size"] = self.world_size
            record["save_id"] = self._save_id  # commit merges only the records of one save
            assert self.rank is not None  # set up by DCP (or force_rank) before any write
            where = locate(self.path) / rank_record_name(self.rank)
            storage_for(where).write_file(where, json.dumps(record, sort_keys=True))
            return
        # What FileSystemWriter.finish does, but through the one .metadata writer and the storage
        # interface (DCP's goes through its own FileSystem), which also gives the manifest its CRC-32.
        stored = {wr.index: wr.storage_data for rank_results in clean for wr in rank_results}
        files[METADATA_NAME] = write_metadata(self.path, with_storage(metadata, stored))
        if self.on_commit is not None:
            self.on_commit(metadata, files)


def write_items(
    directory: str | os.PathLike,
    name: str,
    items: list[tuple[MetadataIndex, bool]],
    resolve: Callable[[MetadataIndex], Any],
    *,
    gates=(),
) -> tuple[list[StorageInfo], tuple[str, FileRecord]]:
    """Write one rank's data file ``directory/name``: each ``(index, is_bytes)`` item in order; where each landed.

    The layout of DCP's ``FileSystemWriter``: a byte item is its pickled bytes,
    a tensor chunk a ``torch.save`` archive of exactly the chunk (so plain DCP
    reads it), written from the tensor's own bytes (:mod:`checkpoint.chunk_archive`)
    with their CRC-32 computed alongside. ``resolve(index)`` gives the bytes or the
    tensor. Equal byte values are stored once and every key points at that range
    (a param group's options, keyed per parameter in torch's flattened layout).
    ``gates`` (:class:`~checkpoint.staging.StagingGate`) learn the plan and each item once written.
    Returns the storage of each item and the file's ``(name, record)``; the file is fsync'd.
    """
    for gate in gates:
        gate.begin([index for index, _ in items])
    out = DataFile(directory, name)
    where: list[StorageInfo] = []
    stored: dict[bytes, StorageInfo] = {}
    try:
        for index, is_bytes in items:
            data = resolve(index)
            if is_bytes:
                key = bytes(data)
                info = stored.get(key)
                if info is None:
                    info = stored[key] = out.add_bytes(data)
            else:
                # write_tensor named here, not inside DataFile: tests slow or break this very call
                # by replacing checkpoint.storage.write_tensor
                info = out.add_tensor(data, write_tensor)
            where.append(info)
            for gate in gates:
                gate.written(index.fqn)
    except BaseException:
        out.abort()
        raise
    return where, (out.name, out.finish())


@contextlib.contextmanager
def quiet_single_process():
    """Silence DCP's warning that it saves / loads in one process: here that is asked for, not guessed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def rank_record(metadata: Metadata, results: list[WriteResult], files: dict[str, FileRecord]) -> dict:
    """One rank's chunks, their storage and its files, as JSON-able plain values (see :func:`checkpoint.commit.merge_metadata`)."""
    where = {
        (r.index.fqn, tuple(r.index.offset) if r.index.offset is not None else None): r.storage_data for r in results
    }
    tensors, blobs = {}, {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = []
            for chunk in item.chunks:
                info = where[(key, tuple(chunk.offsets))]
                chunks.append([list(chunk.offsets), list(chunk.sizes), info.relative_path, info.offset, info.length])
            tensors[key] = {"dtype": dtype_name(item.properties.dtype), "size": list(item.size), "chunks": chunks}
        else:
            info = where[(key, None)]
            blobs[key] = [info.relative_path, info.offset, info.length]
    return {
        "tensors": tensors,
        "bytes": blobs,
        "planner_data": {k: list(v) for k, v in (metadata.planner_data or {}).items()},
        "files": {k: [v.size, v.crc32] for k, v in sorted(files.items())},
    }


def rank_record_problem(record: Any) -> str | None:
    """What is wrong with a parsed rank record (what :func:`rank_record` writes, plus ``world_size`` and
    ``save_id``), one phrase, or ``None``: :func:`checkpoint.commit.commit` merges only records that pass."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    fields = {"tensors": dict, "bytes": dict, "planner_data": dict, "files": dict, "world_size": int}
    for name, kind in fields.items():
        if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool):
            return f"{name} is missing or not a JSON {kind.__name__}"
    if not isinstance(record.get("save_id"), (str, type(None))):
        return "save_id is not a string"
    for key, item in record["tensors"].items():
        if not (
            isinstance(item, dict)
            and isinstance(getattr(torch, str(item.get("dtype")), None), torch.dtype)
            and _ints(item.get("size"))
            and isinstance(item.get("chunks"), list)
            and all(_stored_chunk(c) for c in item["chunks"])
        ):
            return f"tensor {key[:200]!r} is not a dtype, a shape and chunks of [offsets, sizes, file, offset, length]"
    for key, where in record["bytes"].items():
        if not _stored_range(where):
            return f"value {key[:200]!r} is not stored as [file, offset, length]"
    for key, nested in record["planner_data"].items():
        if not (isinstance(nested, list) and all(isinstance(p, (str, int)) for p in nested)):
            return f"the path of {key[:200]!r} is not a list of names"
    for name, size_crc in record["files"].items():
        problem = check_relative_name(name)
        if problem is not None or not (_ints(size_crc) and len(size_crc) == 2 and size_crc[1] <= 0xFFFFFFFF):
            return f"file {name[:200]!r}: {problem or 'not [size, crc32]'}"
    return None


def _ints(values: Any) -> bool:
    return (
        isinstance(values, list)
        and len(values) <= 64
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in values)
    )


def _stored_range(where: Any) -> bool:
    return isinstance(where, list) and len(where) == 3 and isinstance(where[0], str) and _ints(where[1:])


def _stored_chunk(chunk: Any) -> bool:
    return (
        isinstance(chunk, list)
        and len(chunk) == 5
        and _ints(chunk[0])
        and _ints(chunk[1])
        and len(chunk[0]) == len(chunk[1])
        and _stored_range(chunk[2:])
    )
