"""Save and load nested state dicts in the ``fsdp_dtensor`` format.

:func:`save_state_dict` and :func:`load_state_dict` are the layer under
:func:`checkpoint.save` / :func:`checkpoint.load`; they take any nested dict
of tensors, DTensors, flat-shard tensors (with a ``fsdp_shard_spec``),
:func:`checkpoint.shard` objects and picklable values.

Communication: every save starts with one small gather agreeing that every
rank's values can be saved (weights-only loadable, Stateful ``state_dict()``
calls that returned). Then a save in the default ``mode="collective"`` costs DCP's fixed
plan exchange (a gather and a scatter) and its final gather + broadcast,
whatever the number of tensors (errors of any rank, the conversion of the
state dict included, are gathered there and raised on every rank);
``mode="scale"`` costs three more small gathers, each agreeing on whether a step
failed anywhere (rank 0 prepared the target; every rank wrote; rank 0 merged
the per-rank metadata and committed, :func:`checkpoint.commit.commit`). A load
reads no more than each rank's own chunks and the merged ``.metadata``; under
an initialised process group it ends with one small gather agreeing on
success, so a damaged file one rank read raises on every rank. With
replicated DTensors (HSDP, DDP over a device mesh) one replica reads and the
others receive (:mod:`checkpoint.replicas`): then the ranks also agree once
the reads are done, before the broadcasts, so a failed read never leaves a
rank waiting in one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import PurePath
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# set_element: the inverse of DCP's key flattening (no public name); needed because load_flat loads flat keys
# itself; renamed -> import fails, changed path format -> loaded values land in the wrong place
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.atomic import (
    DEFAULT_LOCK_TIMEOUT,
    output_path,
)
from checkpoint.commit import DEFAULT_MAX_CHUNK_BYTES, commit_ranks, commit_staged, new_save_id, staged_save_id
from checkpoint.convert import (
    assign_back,
    convert_tree,
    flatten_state_dict,
    load_stateful,
    materialize_meta,
    resolve_stateful,
    to_checkpointable,
)
from checkpoint.errors import some_of
from checkpoint.gc_pause import paused_gc
from checkpoint.object_commit import ConcurrentSaveError, protocol_for
from checkpoint.opener import (
    CheckpointCorruptError,
    OpenCheckpoint,
    open_checkpoint,
    read_failure,
)
from checkpoint.planner import FsdpSavePlanner
from checkpoint.reader import DEFAULT_MAX_READ_BYTES, DirectReader, ReadBudget
from checkpoint.replicas import ReplicaDims, ReplicaShare, replica_dims
from checkpoint.retention import retain
from checkpoint.safe_unpickle import SafeLoadPlanner, check_saved_values
from checkpoint.save_errors import (
    CheckpointLoadError,
    agree_on_failure,
    raise_on_every_rank,
    raise_unwrapped,
    unwrap_dcp_error,
)
from checkpoint.save_plan import PlannedSave
from checkpoint.save_queue import wait_for_async_save
from checkpoint.storage import FsdpWriter, quiet_single_process
from checkpoint.storage_backend import locate
from checkpoint.training_state import unasked_group_layout
from offload_fsdp.shard_spec import shard_spec_of

__all__ = [
    "DEFAULT_MAX_READ_BYTES",
    "CheckpointCorruptError",
    "LoadReport",
    "OpenCheckpoint",
    "ReadOptions",
    "load_state_dict",
    "open_checkpoint",
    "save_state_dict",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class LoadReport:
    """What a load did not do; all empty after a strict load."""

    missing_keys: list[str] = field(default_factory=list)
    """keys the caller asked for that the checkpoint lacks"""
    unexpected_keys: list[str] = field(default_factory=list)
    """keys the checkpoint holds, in the sections the caller asked for, that the caller lacks"""
    mismatched_keys: list[str] = field(default_factory=list)
    """``"key: saved (shape) vs local (shape)"`` for keys present on both sides with different shapes / kinds"""
    peak_read_buffer_bytes: int = 0
    """the most bytes this rank held at once in the reader's own host buffers (bytes that could not be read
    straight into their destination: another dtype, part of a chunk); at most ``max_read_bytes`` unless one
    item alone is larger. Not a problem: ignored by ``bool(report)``"""

    def __bool__(self) -> bool:
        return bool(self.missing_keys or self.unexpected_keys or self.mismatched_keys)

    def fix(self) -> str:
        """What a strict load's error tells the user to do about these keys."""
        fix = "pass strict=False to load the rest (the skipped keys are listed on the result)"
        if self.mismatched_keys:
            return (
                f"{fix}, or rewrite the checkpoint to this model's shapes with `fsdp-ckpt reshard SRC DST` and "
                "--reshape / --split / --merge / --stack (docs/cli.md)"
            )
        if self.missing_keys and self.unexpected_keys:
            return f"{fix}, or rename the checkpoint's keys with `fsdp-ckpt reshard SRC DST --rename REGEX REPLACEMENT`"
        return fix

    def describe(self) -> str:
        parts = []
        for label, keys in (
            ("missing", self.missing_keys),
            ("unexpected", self.unexpected_keys),
            ("mis-shaped", self.mismatched_keys),
        ):
            if keys:
                parts.append(f"{label}: {some_of(keys, 10)}")
        return "; ".join(parts)


@dataclass(frozen=True)
class ReadOptions:
    """How a load reads, beyond what it reads: its host-memory cap and the replicas' shared reads."""

    max_read_bytes: int | None = DEFAULT_MAX_READ_BYTES
    """cap on the bytes held at once in the reader's own host buffers, and on one replica broadcast;
    ``None``: no cap"""
    read_once_per_replica: bool = True
    """replicated DTensors (HSDP / DDP mesh dims): one replica reads from storage, the others receive the
    bytes over the process group (only in a collective load)"""
    process_group: dist.ProcessGroup | None = None
    """the ranks loading together (the default group when ``None``)"""
    collective: bool = False
    """every rank of ``process_group`` loads (see :func:`read_options`); ``False``: a rank-local load"""
    replicas: ReplicaDims | None = None
    """the mesh dimensions along which what every rank loads whole is read once (:meth:`sharing_replicas_of`)"""

    def __post_init__(self) -> None:
        ReadBudget(self.max_read_bytes)  # raises ValueError naming max_read_bytes when it is not a byte count

    def sharing_replicas_of(self, targets: Iterable[Any]) -> ReadOptions:
        """These options, with :attr:`replicas` found among the values being loaded (their DTensors' meshes)."""
        if not (self.collective and self.read_once_per_replica):
            return self
        return replace(self, replicas=replica_dims(targets, self.process_group))


LOCAL_READS = ReadOptions()
"""A rank-local load's options: the default cap, no replica sharing"""


class _AgreedFailure(BaseException):
    """A load failure every rank already learned of (in the agreement before replica broadcasts): carried up
    to :func:`load_on_every_rank` past any ``except Exception``, which then raises ``error`` without
    agreeing again (the other ranks agreed already and will not)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _dist_info(process_group) -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group), True
    return 0, 1, False


def read_options(
    *,
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
    max_read_bytes: int | None = DEFAULT_MAX_READ_BYTES,
    read_once_per_replica: bool = True,
) -> ReadOptions:
    """The :class:`ReadOptions` of a load called with these arguments (collective when a process group is
    initialised and not ``no_dist``)."""
    collective = not no_dist and dist.is_available() and dist.is_initialized()
    return ReadOptions(max_read_bytes, read_once_per_replica, process_group, collective)


def load_on_every_rank(
    load: Callable[[], T], path: str | os.PathLike, *, process_group: dist.ProcessGroup | None, no_dist: bool
) -> T:
    """``load()`` (rank-local reads), then one small gather agreeing on its success (unless ``no_dist`` or no
    process group is initialised): a rank whose read failed raises its own error, every other rank
    :class:`~checkpoint.save_errors.CheckpointLoadError`, so no rank goes on to train alone and wait forever.
    A failure already agreed on inside ``load()`` (before replica broadcasts) is raised without a second gather.
    """
    distributed = not no_dist and dist.is_available() and dist.is_initialized()
    result = error = None
    try:
        with paused_gc():
            result = load()
    except _AgreedFailure as agreed:
        raise agreed.error from None
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree_on_failure()
        error = exc
    failures = agree_on_failure(error, group=process_group, distributed=distributed)
    if failures:
        raise CheckpointLoadError(path, failures)
    return cast(T, result)  # no rank failed: load() returned


def save_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    mode: str = "collective",
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    process_group: dist.ProcessGroup | None = None,
    storage_options: dict | None = None,
    keep_last: int | None = None,
    lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
) -> None:
    """Save ``state_dict`` (this rank's part) as a committed checkpoint at ``path``; all ranks call it.

    Atomic: nothing at ``path`` changes until the new checkpoint is complete
    (see :mod:`checkpoint.atomic`); a save to a path another save is writing
    waits for it. An async save still in flight is finished first, and raises
    here if it failed. ``path`` (normalised: ``sub/..`` is the directory it names; the
    current directory is refused) must be absent, empty or a committed checkpoint
    holding only its own files (checked before anything is written). An error on any rank
    raises on every rank (:class:`~checkpoint.save_errors.CheckpointSaveError`
    on the others); a failed save leaves no staging behind. ``mode="scale"``
    trades DCP's plan exchange for three small gathers; in it, plain tensors are
    taken from rank 0 and the checkpoint is committed by rank 0.

    ``path`` may be a URL (``s3://bucket/prefix``, any fsspec URL; ``storage_options`` go to its
    file system): it is saved by the object-store protocol (:mod:`checkpoint.object_commit`; there a
    second save racing on the same path fails with :class:`~checkpoint.object_commit.ConcurrentSaveError`
    instead of waiting). ``keep_last=N``: once committed, only the ``N`` newest committed checkpoints
    beside ``path`` are kept (:func:`checkpoint.retention.retain`). ``lock_timeout``: seconds to wait for
    another save holding ``path``'s write lock (default :data:`~checkpoint.atomic.DEFAULT_LOCK_TIMEOUT`),
    then ``TimeoutError`` naming its lock file and holder, nothing written; ``None`` waits as long as it takes.
    """
    path = output_path(path, storage_options)  # resolved once: a local path or a URL, bound to its storage
    wait_for_async_save()
    with paused_gc():
        write_state_dict(
            state_dict,
            path,
            mode=mode,
            max_chunk_bytes=max_chunk_bytes,
            process_group=process_group,
            keep_last=keep_last,
            check_values=True,
            lock_timeout=lock_timeout,
        )


def _resolved_and_checked(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Stateful values' ``state_dict()`` once, in sorted key order on every rank (they may run collectives;
    ``dcp.save`` would call them in each rank's dict order), and a check that what we save loads weights-only."""
    resolved, _ = resolve_stateful(state_dict)
    check_saved_values(resolved)
    return resolved


def write_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    mode: str = "collective",
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    process_group: dist.ProcessGroup | None = None,
    keep_last: int | None = None,
    check_values: bool = False,
    distributed: bool | None = None,
    lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
) -> None:
    """:func:`save_state_dict` without waiting for an async save (what the async writer thread runs).

    The caller has resolved ``path`` with :func:`~checkpoint.storage_backend.locate`. ``check_values``:
    resolve Stateful values and check that every value loads weights-only as the save's first step, whose
    failure on one rank the save's first collective already raises on every rank (no rank is left waiting,
    and no collective is added); without it the caller has done so (an async save, before staging).
    ``distributed``: whether the save was started in a process group (``None``: whether one is initialised
    now); a save started in one fails if the group is destroyed before it has prepared the target.
    """
    if mode not in ("collective", "scale"):
        raise ValueError(f"mode must be 'collective' or 'scale', got {mode!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be None (keep everything) or at least 1, got {keep_last}")
    rank, world_size, in_group = _dist_info(process_group)
    distributed = in_group if distributed is None else distributed
    _refuse_lost_group(path, distributed)
    scale = mode == "scale" and distributed
    # whole_as_is: the collective save (checkpoint.save_plan) stores a whole plain tensor without a wrapper
    convert = partial(
        convert_tree, rank=rank, replicas_on_rank0_only=scale, max_chunk_bytes=max_chunk_bytes, whole_as_is=not scale
    )
    if check_values:
        convert = partial(_checked_then, convert)
    # the storage, resolved once: renames and a lock, or the object-store commit
    protocol = protocol_for(path, lock_timeout=lock_timeout)
    with contextlib.ExitStack() as held:
        prepared: list = []

        def prepare() -> PurePath:  # rank 0, before anything is written
            _refuse_lost_group(path, distributed)
            staged = protocol.begin(held)
            prepared.append(staged)
            return staged

        try:
            if protocol.needs_agreement:
                # A fresh save id per save: rank 0 makes the staging directory, the others learn its name.
                staged = _agree_on_staging(protocol, prepare, rank, process_group, distributed)
                prepare = None  # type: ignore[assignment]  # done
            else:
                staged = protocol.staged()
            if scale:
                _save_scale(
                    state_dict, protocol, rank, world_size, max_chunk_bytes, convert, prepare, process_group, staged
                )
            else:
                _save_collective(
                    state_dict,
                    protocol,
                    world_size,
                    max_chunk_bytes,
                    convert,
                    prepare,
                    process_group,
                    distributed,
                    staged,
                )
        except BaseException as exc:
            if prepared:
                lost = protocol.lost(prepared[0]) if not isinstance(exc, ConcurrentSaveError) else None
                protocol.abandon(prepared[0])  # every rank has stopped writing: DCP / agree() raised on all of them
                if lost is not None:
                    raise lost from exc  # its files vanished under it: the raw error would not say why
            if not isinstance(exc, CheckpointException):
                raise
            raise_unwrapped(exc, path, rank if distributed else 0)
    if keep_last is not None and rank == 0:
        retain(path, keep_last=keep_last, wait=False)  # this very save (maybe async) has committed


def _checked_then(convert: Callable[[dict[str, Any]], Any], state_dict: dict[str, Any]) -> Any:
    return convert(_resolved_and_checked(state_dict))


def _agree_on_staging(protocol, prepare, rank, process_group, distributed) -> PurePath:
    """Rank 0 begins the save; every rank learns the staging directory's name, or rank 0's error."""
    error: Exception | None = None
    name = None
    if rank == 0:
        try:
            name = prepare().name
        except Exception as exc:  # noqa: BLE001 - raised on every rank
            error = exc
    raise_on_every_rank(error, protocol.path, group=process_group, distributed=distributed)
    if distributed:
        box = [name]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group
        )
        name = box[0]
    return protocol.staged(name)


def _refuse_lost_group(path: str | os.PathLike, distributed: bool) -> None:
    """Raise if a save started in a process group has lost it (another thread destroyed it).

    ``dcp.save`` decides whether it is distributed from ``dist.is_initialized()`` when it starts: without the
    group, every rank would take itself for a single process, coordinator included, and commit its shard alone
    (and report success). Checked again in ``prepare()``, which every coordinator runs before anything is
    written, after ``dcp.save`` has decided: a rank that goes on past it meets the others in its collectives,
    so it reports success only once the commit came back to it through them.
    """
    if distributed and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"the process group was destroyed before the save to {str(path)!r} could prepare it: not committed"
        )


def _save_collective(
    state_dict, protocol, world_size, max_chunk_bytes, convert, prepare, process_group, distributed, staged
) -> None:
    """The collective save (:mod:`checkpoint.save_plan`: DCP's layout, its plan made once per layout)."""
    info = {"mode": "collective", "max_chunk_bytes": max_chunk_bytes}
    PlannedSave(
        staged,
        convert=convert,
        prepare=prepare or (lambda: None),  # None: the object-store protocol prepared the staging already
        commit=partial(_commit_collective, protocol, staged, world_size, info),
        group=process_group,
        distributed=distributed,
        path=protocol.path,
    ).run(state_dict)


def _save_scale(
    state_dict, protocol, rank, world_size, max_chunk_bytes, convert, prepare, process_group, staged
) -> None:
    """Each rank writes its files and record alone; rank 0 commits once every rank succeeded.

    Three small gathers (:func:`~checkpoint.save_errors.raise_on_every_rank`): after rank 0
    prepared the target and every rank converted its state; after the writes; after rank 0's commit.
    """
    path = protocol.path
    agree = partial(raise_on_every_rank, path=path, group=process_group, distributed=True)
    error: BaseException | None = None
    try:
        converted = convert(state_dict)
        if rank == 0:
            if prepare is not None:
                prepare()
            new_save_id(staged)  # in the records of this save only: commit refuses a straggler of another
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    agree(error)
    save_id = None
    try:
        save_id = staged_save_id(staged)
        writer = FsdpWriter(staged, force_rank=rank, world_size=world_size, save_id=save_id)
        with quiet_single_process():
            # no_dist: DCP's own closing barrier would leave the other ranks waiting if this one failed
            dcp.save(converted, storage_writer=writer, planner=FsdpSavePlanner(validate_cover=False), no_dist=True)
    except CheckpointException as exc:
        error = unwrap_dcp_error(exc, path, 0)  # DCP ran this rank alone, as rank 0
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    agree(error)  # every rank's files are durable past it
    error = None
    if rank == 0:
        try:
            info = {"max_chunk_bytes": max_chunk_bytes}
            commit_ranks(path, world_size, extra_info=info, save_id=save_id, staged=staged, protocol=protocol)
        except Exception as exc:  # noqa: BLE001
            error = exc
    agree(error)


def _commit_collective(protocol, staged, world_size, info, metadata: Metadata, files, keys) -> None:
    commit_staged(
        protocol.path, metadata, files, world_size, extra_info=info, staged=staged, protocol=protocol, keys=keys
    )


def load_flat(
    opened: OpenCheckpoint,
    targets: dict[str, Any],
    *,
    strict: bool,
    optional: frozenset[str] | set[str] = frozenset(),
    scope: tuple[str, ...] = ("",),
    ignored: frozenset[str] | set[str] = frozenset(),
    options: ReadOptions = LOCAL_READS,
) -> tuple[LoadReport, dict[str, Any]]:
    """Fill flat ``targets`` (dotted key -> tensor / placeholder) from ``opened``; tensors in place.

    Returns the report and the loaded non-tensor values by key. ``optional``
    keys are never reported missing; only checkpoint keys starting with one of
    ``scope`` and not in ``ignored`` count as unexpected. Strict: raises ``ValueError`` naming every
    problem before reading anything. In a collective load (``options``) every rank calls it with the same keys.
    """
    saved = opened.saved
    _refuse_meta_targets(targets)
    report = LoadReport()
    loadable: dict[str, Any] = {}
    for key, value in targets.items():
        if key not in saved:
            if key not in optional:
                report.missing_keys.append(key)
            continue
        value = _load_target(value, name=key)
        problem = _mismatch(key, saved[key], value)
        if problem:
            report.mismatched_keys.append(problem)
        else:
            loadable[key] = value
    if scope:  # a load of a few keys (scope=()) reports none: no pass over every saved key
        report.unexpected_keys = [k for k in saved if k not in targets and k.startswith(scope) and k not in ignored]
    if strict and report:
        raise ValueError(
            f"checkpoint {str(opened.path)!r} does not match what is being loaded: {report.describe()}; {report.fix()}"
        )
    if loadable:
        replicas = None
        if options.collective and options.read_once_per_replica:
            replicas = ReplicaShare.of(
                {k: targets[k] for k in loadable},
                shared=options.replicas,
                bucket_bytes=options.max_read_bytes or DEFAULT_MAX_READ_BYTES,
            )
        if replicas is None:
            report.peak_read_buffer_bytes = _read(opened, loadable, options)
        else:
            received = replicas.received()
            reads = {k: v for k, v in loadable.items() if k not in received}
            report.peak_read_buffer_bytes = _read_then_share(opened, reads, options)
            loadable.update(reads)  # the non-tensor values read here (tensors were filled in place)
            replicas.send(loadable)
    values = {k: v for k, v in loadable.items() if not isinstance(v, torch.Tensor)}
    return report, values


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
"""Types of the values a load reads into as they are (never a subclass: a DTensor, a shard)"""


def _load_target(value: Any, *, name: str) -> Any:
    """What a load reads ``value`` through: a whole plain tensor as it is (read straight into, see
    :meth:`~checkpoint.reader.DirectReader.read_whole_tensors`, or by DCP's planner, as
    :func:`~checkpoint.convert.to_checkpointable`'s whole-tensor shard would be: that wrapper costs ~25 us a
    tensor), anything else converted."""
    if type(value) in _PLAIN_TENSORS and shard_spec_of(value) is None:
        return value
    return to_checkpointable(value, name=name)


def _refuse_meta_targets(targets: dict[str, Any]) -> None:
    """A meta-device tensor has no storage to fill in place: say so before reading (never a read failure)."""
    meta = [k for k, v in targets.items() if isinstance(v, torch.Tensor) and v.is_meta]  # not .device: ~1 us a key
    if meta:
        shown = ", ".join(meta[:5]) + (f", ... ({len(meta)} in all)" if len(meta) > 5 else "")
        raise TypeError(
            f"{shown}: on the meta device, with no storage to load into; materialise the module first "
            "(module.to_empty(device=...)), or load with checkpoint.load_state_dict, which replaces meta-device "
            "values in the state dict with loaded tensors as dcp.load does"
        )


def _read(opened: OpenCheckpoint, loadable: dict[str, Any], options: ReadOptions) -> int:
    """Read ``loadable`` on this rank; the reader's peak buffer bytes.

    A key the manifest lists as sharing its source key's stored value (torch's flattened layout keys each
    param group's options once per parameter) takes a copy of the source's value, read once: the open
    checked that both name the same bytes (:func:`checkpoint.opener.consistency_problems`).
    """
    if not loadable:
        return 0
    shared = _shared_sources(opened, loadable)
    reads = {k: v for k, v in loadable.items() if k not in shared}
    sources_only = {source for source in shared.values() if source not in reads}
    reads.update(dict.fromkeys(sources_only))
    check = opened.content_check()
    with opened.reading():
        peak = _read_flat(opened, reads, check, options.max_read_bytes)
    loadable.update({k: v for k, v in reads.items() if k not in sources_only})
    copies = {source: _copier(reads[source]) for source in set(shared.values())}
    loadable.update({key: copies[source](reads[source]) for key, source in shared.items()})
    return peak


def _shared_sources(opened: OpenCheckpoint, keys: dict[str, Any]) -> dict[str, str]:
    """key -> its source key, for each of ``keys`` that the manifest lists in :attr:`~checkpoint.manifest.Manifest.shared`
    (stored where its source key is).

    One pass over the non-tensor ``keys``, each split into the manifest's ``<under>.<name>.<field>`` at each of
    its dots, whatever the number of keys listed (torch's flattened layout lists one per parameter and option:
    a load of a few keys would pay for all of them).
    """
    if opened.manifest is None or not opened.manifest.shared:
        return {}
    saved = opened.saved
    fields_of: dict[str, dict[str, str]] = {}  # "<under>.<name>" -> field -> source
    for family in opened.manifest.shared:
        for name in family.names:
            fields_of.setdefault(".".join((*family.under, name)), {}).update(family.fields)
    sources: dict[str, str] = {}
    for key, value in keys.items():
        if type(value) in _PLAIN_TENSORS:  # a listed key holds a pickled value
            continue
        dot = key.find(".")
        while dot >= 0:  # a name or a field may hold dots (a flattened state dict's keys do): try each split
            source = fields_of.get(key[:dot], {}).get(key[dot + 1 :])
            if source is not None:
                if source != key and source in saved:  # source not there: the key is read as itself
                    sources[key] = source
                break
            dot = key.find(".", dot + 1)
    return sources


_IMMUTABLE = (bool, int, float, complex, str, bytes, type(None))


def _copier(value: Any) -> Callable[[Any], Any]:
    """How ``value`` is given to one more key: itself when immutable (a float, a tuple of them: torch's option
    values), else a copy, so no two keys' loaded values are one object (as when each is unpickled on its own).
    Decided once per value: a list naming every parameter (``param_names``), copied for each of them, must
    not cost a Python step per name (O(N^2)).
    """
    if type(value) in _IMMUTABLE or (type(value) is tuple and all(type(v) in _IMMUTABLE for v in value)):
        return _itself
    if type(value) in (list, dict) and all(
        type(v) in _IMMUTABLE for v in (value.values() if type(value) is dict else value)
    ):
        return copy.copy  # a C copy: its items are immutable
    return copy.deepcopy


def _itself(value: T) -> T:
    return value


def _read_then_share(opened: OpenCheckpoint, reads: dict[str, Any], options: ReadOptions) -> int:
    """This rank's reads, then one gather agreeing that every rank's succeeded (before the replica broadcasts);
    the reader's peak buffer bytes."""
    error = None
    peak = 0
    try:
        peak = _read(opened, reads, options)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree_on_failure()
        error = exc
    try:
        failures = agree_on_failure(error, group=options.process_group, distributed=True)
    except Exception as exc:  # noqa: BLE001 - this rank's own error, re-raised by agree_on_failure()
        raise _AgreedFailure(exc) from None
    if failures:
        raise _AgreedFailure(CheckpointLoadError(opened.path, failures))
    return peak


def _read_flat(opened: OpenCheckpoint, loadable: dict[str, Any], check, max_read_bytes: int | None) -> int:
    """``loadable`` from ``opened``: plain tensors stored whole read straight in, the rest by one DCP load;
    then the streamed CRC-32 check of the files read.

    Returns the reader's peak buffer bytes (:attr:`LoadReport.peak_read_buffer_bytes`).
    """
    reader = DirectReader(
        opened.path,
        None if opened.index is not None else opened.metadata,  # through a load index: the plan's, below
        direct=opened.manifest is not None,
        check=check,
        max_read_bytes=max_read_bytes,
        index=opened.index,
    )
    planner = SafeLoadPlanner(
        flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True, where=str(opened.path)
    )
    try:
        plain = {k: v for k, v in loadable.items() if type(v) in _PLAIN_TENSORS}
        rest = reader.read_whole_tensors(plain)
        planned = {k: v for k, v in loadable.items() if k not in plain or k in rest}
        if planned:
            _load_locally(planned, reader, planner, opened.metadata_of(planned))
            loadable.update(planned)  # the planner puts the non-tensor values it reads in the dict it was given
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        raise read_failure(exc, opened.path) from None
    if check is not None:
        check.finish()  # raises naming the file whose bytes did not match
    return reader.budget.peak


def _load_locally(
    state_dict: dict[str, Any], reader: DirectReader, planner: SafeLoadPlanner, metadata: Metadata
) -> None:
    """The steps of ``dcp.load(..., no_dist=True)`` with ``metadata`` (holding every key of ``state_dict``),
    through DCP's public planner and storage-reader protocol.

    ``dcp.load`` itself adds, per key, a runtime ``Stateful`` protocol check (~10 us each; Stateful values
    were resolved by the caller already) and logging wrappers per step: a tenth of a 10,000-parameter load.
    """
    planner.set_up_planner(state_dict, metadata, is_coordinator=True)
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    (plan,) = reader.prepare_global_plan(planner.create_global_plan([plan]))
    reader.read_data(planner.finish_plan(plan), planner).wait()


def _mismatch(key: str, saved, value) -> str | None:
    is_tensor = isinstance(saved, TensorStorageMetadata)
    if is_tensor != isinstance(value, torch.Tensor):
        kinds = ("a tensor", "a non-tensor value")
        return f"{key}: saved as {kinds[not is_tensor]}, local is {kinds[is_tensor]}"
    if is_tensor and tuple(saved.size) != tuple(value.shape):
        return f"{key}: saved {tuple(saved.size)} vs local {tuple(value.shape)}"
    return None


def load_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    verify: str = "crc",
    require_manifest: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    storage_options: dict | None = None,
    max_read_bytes: int | None = DEFAULT_MAX_READ_BYTES,
    read_once_per_replica: bool = True,
) -> LoadReport:
    """Fill ``state_dict`` from the checkpoint at ``path``: tensors in place, other values replaced.

    Works at any world size and layout. Each rank reads its own part; when a
    process group is initialised, all ranks of ``process_group`` call it and
    agree at the end (one small gather): an error on one rank raises on every
    rank (:class:`~checkpoint.save_errors.CheckpointLoadError` on the others).
    ``no_dist=True``: a rank-local load with no communication (one rank alone reading). Keys are the dotted
    paths of the nested dict (``{"model": {"w": t}}`` is ``model.w``).
    ``strict`` raises ``ValueError`` naming missing / unexpected (within the
    top-level sections given) / mis-shaped keys; otherwise they are skipped and
    returned in the :class:`LoadReport`. ``verify`` / ``require_manifest``: see :func:`open_checkpoint`.

    As ``dcp.load`` does:

    * a Stateful value (``state_dict()`` / ``load_state_dict()``: a module, a
      dataloader) is filled through its ``state_dict()`` and then given it by
      ``load_state_dict()``; these calls run in sorted key order on every rank,
      whatever order each rank's dict was built in (they may run collectives);
    * a meta-device tensor (a model built on ``meta``) is replaced by a loaded
      tensor of the same kind (``DTensor`` placements kept) on the process
      group's device (:func:`meta_device_target`);
    * every other top-level entry is assigned back (``state_dict[key] = value``),
      nested dicts filled in place.

    ``max_read_bytes`` caps the bytes this rank holds at once in read buffers of its own (bytes that cannot
    be read straight into their destination: another dtype, part of a chunk), so a load's extra host memory
    stays within it plus one larger item (``None``: no cap); the peak is the report's
    ``peak_read_buffer_bytes``. ``read_once_per_replica`` (collective loads): a DTensor replicated over mesh
    dimensions (HSDP, DDP) is read from storage by the replica at coordinate 0 only and broadcast along
    them to the others, in buckets of at most ``max_read_bytes``; ``False``: every rank reads its own.
    ``path`` may be a URL (``s3://bucket/prefix``; ``storage_options`` go to its fsspec file system).
    """
    path = locate(path, storage_options)
    device = meta_device_target(process_group)
    options = read_options(
        process_group=process_group,
        no_dist=no_dist,
        max_read_bytes=max_read_bytes,
        read_once_per_replica=read_once_per_replica,
    )
    load = partial(
        _load_state_dict,
        state_dict,
        path,
        strict=strict,
        verify=verify,
        require_manifest=require_manifest,
        device=device,
        options=options,
    )
    return load_on_every_rank(load, path, process_group=process_group, no_dist=no_dist)


def meta_device_target(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a load materialises a meta-device value: where ``dcp.load`` does.

    The current accelerator when the process group has a backend for it
    (``nccl`` for CUDA: the group's default device), else the host (gloo, or no group).
    """
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = dist.Backend.default_device_backend_map.get(accelerator.type)
    if backend is None or backend not in str(dist.get_backend(process_group)):
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _load_state_dict(
    state_dict, path, *, strict: bool, verify: str, require_manifest: bool, options: ReadOptions, device: torch.device
) -> LoadReport:
    opened = open_checkpoint(path, verify=verify, require_manifest=require_manifest)
    resolved, stateful = resolve_stateful(state_dict)  # Stateful values load through their state dicts
    flat, mappings = flatten_state_dict(resolved)
    materialized = {k: m for k, v in flat.items() if (m := materialize_meta(v, name=k, device=device)) is not v}
    flat.update(materialized)
    scope = tuple(f"{k}." for k in state_dict)
    options = options.sharing_replicas_of(flat.values())
    saved = opened.saved
    ignored = unasked_group_layout(saved, flat.keys())  # ours stores both of torch's optimizer layouts
    report, values = load_flat(opened, flat, strict=strict, scope=scope, ignored=ignored, options=options)
    for key, value in {**materialized, **values}.items():
        where = mappings[key]
        set_element(resolved, where, value)
        if len(where) > 1 and not any(where[: len(p)] == p for p, _ in stateful):
            set_element(state_dict, where, value)  # nested containers are the caller's own, filled in place
    load_stateful(resolved, stateful)
    assign_back(state_dict, resolved, stateful)
    return report
