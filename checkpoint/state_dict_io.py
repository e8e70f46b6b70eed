"""Save and load nested state dicts in the ``fsdp_dtensor`` format.

:func:`save_state_dict` and :func:`load_state_dict` are the layer under
:func:`checkpoint.save` / :func:`checkpoint.load`; they take any nested dict
of tensors, DTensors, flat-shard tensors (with a ``fsdp_shard_spec``),
:func:`checkpoint.shard` objects and picklable values.

Communication: a save in the default ``mode="collective"`` costs DCP's fixed
plan exchange (a gather and a scatter) and its final gather + broadcast,
whatever the number of tensors (errors of any rank, the conversion of the
state dict included, are gathered there and raised on every rank);
``mode="scale"`` costs three small gathers, each agreeing on whether a step
failed anywhere (rank 0 prepared the target; every rank wrote; rank 0 merged
the per-rank metadata and committed, :func:`checkpoint.commit.commit`). A load
reads no more than each rank's own chunks and the merged ``.metadata``; under
an initialised process group it ends with one small gather agreeing on
success, so a damaged file one rank read raises on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# flatten_state_dict/set_element: DCP's key flattening and its inverse (no public names); needed because
# load_flat loads flat keys itself; renamed -> import fails, changed key format -> loads miss keys
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.atomic import (
    check_target,
    make_staging,
    remove_staging,
    staging_path,
    write_lock,
)
from checkpoint.commit import DEFAULT_MAX_CHUNK_BYTES, commit_ranks, commit_staged
from checkpoint.convert import (
    convert_tree,
    load_stateful,
    resolve_stateful,
    to_checkpointable,
)
from checkpoint.gc_pause import paused_gc
from checkpoint.opener import (
    CheckpointCorruptError,
    OpenCheckpoint,
    open_checkpoint,
    read_failure,
)
from checkpoint.planner import FsdpSavePlanner
from checkpoint.reader import DirectReader
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

__all__ = [
    "CheckpointCorruptError",
    "LoadReport",
    "OpenCheckpoint",
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

    def __bool__(self) -> bool:
        return bool(self.missing_keys or self.unexpected_keys or self.mismatched_keys)

    def describe(self) -> str:
        parts = []
        for label, keys in (
            ("missing", self.missing_keys),
            ("unexpected", self.unexpected_keys),
            ("mis-shaped", self.mismatched_keys),
        ):
            if keys:
                shown = ", ".join(keys[:10]) + (f", ... ({len(keys)} in all)" if len(keys) > 10 else "")
                parts.append(f"{label}: {shown}")
        return "; ".join(parts)


def _dist_info(process_group) -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group), True
    return 0, 1, False


def load_on_every_rank(
    load: Callable[[], T], path: str | os.PathLike, *, process_group: dist.ProcessGroup | None, no_dist: bool
) -> T:
    """``load()`` (rank-local reads), then one small gather agreeing on its success (unless ``no_dist`` or no
    process group is initialised): a rank whose read failed raises its own error, every other rank
    :class:`~checkpoint.save_errors.CheckpointLoadError`, so no rank goes on to train alone and wait forever.
    """
    distributed = not no_dist and dist.is_available() and dist.is_initialized()
    result = error = None
    try:
        with paused_gc():
            result = load()
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
) -> None:
    """Save ``state_dict`` (this rank's part) as a committed checkpoint at ``path``; all ranks call it.

    Atomic: nothing at ``path`` changes until the new checkpoint is complete
    (see :mod:`checkpoint.atomic`); a save to a path another save is writing
    waits for it. An async save still in flight is finished first, and raises
    here if it failed. ``path`` must be absent, empty or a committed
    checkpoint (checked before anything is written). An error on any rank
    raises on every rank (:class:`~checkpoint.save_errors.CheckpointSaveError`
    on the others); a failed save leaves no staging behind. ``mode="scale"``
    trades DCP's plan exchange for three small gathers; in it, plain tensors are
    taken from rank 0 and the checkpoint is committed by rank 0.
    """
    wait_for_async_save()
    with paused_gc():
        check_saved_values(state_dict)  # before anything is written: what we save must load weights-only
        write_state_dict(state_dict, path, mode=mode, max_chunk_bytes=max_chunk_bytes, process_group=process_group)


def write_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    mode: str = "collective",
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """:func:`save_state_dict` without waiting for an async save (what the async writer thread runs).

    The caller has checked the values with :func:`~checkpoint.safe_unpickle.check_saved_values`
    (an async save does so before staging, so its writer thread does not repeat it).
    """
    if mode not in ("collective", "scale"):
        raise ValueError(f"mode must be 'collective' or 'scale', got {mode!r}")
    rank, world_size, distributed = _dist_info(process_group)
    convert = partial(
        convert_tree, rank=rank, replicas_on_rank0_only=mode == "scale" and distributed, max_chunk_bytes=max_chunk_bytes
    )
    with contextlib.ExitStack() as held:
        prepared = []

        def prepare() -> None:  # rank 0, before anything is written
            held.enter_context(write_lock(path))  # held until committed: one writer per path
            check_target(path)
            make_staging(path)
            prepared.append(True)

        try:
            if mode == "scale" and distributed:
                _save_scale(state_dict, path, rank, world_size, max_chunk_bytes, convert, prepare, process_group)
            else:
                _save_collective(
                    state_dict, path, world_size, max_chunk_bytes, convert, prepare, process_group, distributed
                )
        except BaseException as exc:
            if prepared:
                remove_staging(path)  # every rank has stopped writing: DCP / agree() raised on all of them
            if not isinstance(exc, CheckpointException):
                raise
            raise_unwrapped(exc, path, rank if distributed else 0)


def _save_collective(
    state_dict, path, world_size, max_chunk_bytes, convert, prepare, process_group, distributed
) -> None:
    """The collective save (:mod:`checkpoint.save_plan`: DCP's layout, its plan made once per layout)."""
    info = {"mode": "collective", "max_chunk_bytes": max_chunk_bytes}
    PlannedSave(
        staging_path(path),
        convert=convert,
        prepare=prepare,
        commit=partial(_commit_collective, path, world_size, info),
        group=process_group,
        distributed=distributed,
        path=path,
    ).run(state_dict)


def _save_scale(state_dict, path, rank, world_size, max_chunk_bytes, convert, prepare, process_group) -> None:
    """Each rank writes its files and record alone; rank 0 commits once every rank succeeded.

    Three small gathers (:func:`~checkpoint.save_errors.raise_on_every_rank`): after rank 0
    prepared the target and every rank converted its state; after the writes; after rank 0's commit.
    """
    agree = partial(raise_on_every_rank, path=path, group=process_group, distributed=True)
    error: BaseException | None = None
    try:
        converted = convert(state_dict)
        if rank == 0:
            prepare()
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = exc
    agree(error)
    try:
        writer = FsdpWriter(staging_path(path), force_rank=rank, world_size=world_size)
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
            commit_ranks(path, world_size, extra_info={"max_chunk_bytes": max_chunk_bytes})
        except Exception as exc:  # noqa: BLE001
            error = exc
    agree(error)


def _commit_collective(path, world_size, info, metadata: Metadata, files) -> None:
    commit_staged(path, metadata, files, world_size, extra_info=info)


def load_flat(
    opened: OpenCheckpoint,
    targets: dict[str, Any],
    *,
    strict: bool,
    optional: frozenset[str] | set[str] = frozenset(),
    scope: tuple[str, ...] = ("",),
    ignored: frozenset[str] | set[str] = frozenset(),
) -> tuple[LoadReport, dict[str, Any]]:
    """Fill flat ``targets`` (dotted key -> tensor / placeholder) from ``opened``; tensors in place.

    Returns the report and the loaded non-tensor values by key. ``optional``
    keys are never reported missing; only checkpoint keys starting with one of
    ``scope`` and not in ``ignored`` count as unexpected. Strict: raises ``ValueError`` naming every
    problem before reading anything.
    """
    saved = opened.metadata.state_dict_metadata
    report = LoadReport()
    loadable: dict[str, Any] = {}
    for key, value in targets.items():
        if key not in saved:
            if key not in optional:
                report.missing_keys.append(key)
            continue
        value = to_checkpointable(value, name=key)
        problem = _mismatch(key, saved[key], value)
        if problem:
            report.mismatched_keys.append(problem)
        else:
            loadable[key] = value
    report.unexpected_keys = [k for k in saved if k not in targets and k.startswith(scope) and k not in ignored]
    if strict and report:
        raise ValueError(f"checkpoint {str(opened.path)!r} does not match what is being loaded: {report.describe()}")
    if loadable:
        check = opened.content_check()
        with opened.reading():
            _read_flat(opened, loadable, check)
    values = {k: v for k, v in loadable.items() if not isinstance(v, torch.Tensor)}
    return report, values


def _read_flat(opened: OpenCheckpoint, loadable: dict[str, Any], check) -> None:
    """One DCP load of ``loadable`` from ``opened``, then the streamed CRC-32 check of the files it read."""
    try:
        with quiet_single_process():
            dcp.load(
                loadable,
                # Our own files are read straight into place; a plain DCP directory the DCP way.
                storage_reader=DirectReader(
                    opened.path, opened.metadata, direct=opened.manifest is not None, check=check
                ),
                planner=SafeLoadPlanner(
                    flatten_state_dict=False,
                    flatten_sharded_tensors=False,
                    allow_partial_load=True,
                    where=str(opened.path),
                ),
                no_dist=True,
            )
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        raise read_failure(exc, opened.path) from None
    if check is not None:
        check.finish()  # raises naming the file whose bytes did not match


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
    A Stateful value (``state_dict()`` / ``load_state_dict()``: a module, a
    dataloader), as ``dcp.load`` accepts, is filled through its ``state_dict()``
    and then given it by ``load_state_dict()``.
    """
    load = partial(_load_state_dict, state_dict, path, strict=strict, verify=verify, require_manifest=require_manifest)
    return load_on_every_rank(load, path, process_group=process_group, no_dist=no_dist)


def _load_state_dict(state_dict, path, *, strict: bool, verify: str, require_manifest: bool) -> LoadReport:
    opened = open_checkpoint(path, verify=verify, require_manifest=require_manifest)
    resolved, stateful = resolve_stateful(state_dict)  # Stateful values load through their state dicts
    flat, mappings = flatten_state_dict(resolved)
    scope = tuple(f"{k}." for k in state_dict)
    report, values = load_flat(opened, flat, strict=strict, scope=scope)
    for key, value in values.items():
        set_element(resolved, mappings[key], value)
        if not any(mappings[key][: len(p)] == p for p, _ in stateful):
            set_element(state_dict, mappings[key], value)
    load_stateful(resolved, stateful)
    return report
