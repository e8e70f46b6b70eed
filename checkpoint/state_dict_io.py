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
costs nothing: every rank reads the merged ``.metadata`` and its own chunks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.atomic import (
    check_committed,
    check_target,
    is_committed,
    make_staging,
    remove_staging,
    resolve_for_load,
    staging_path,
    write_lock,
)
from checkpoint.commit import DEFAULT_MAX_CHUNK_BYTES, commit_ranks, commit_staged
from checkpoint.convert import convert_tree, load_stateful, resolve_stateful, to_checkpointable
from checkpoint.manifest import METADATA_NAME, Manifest, checksum_file, read_manifest, verify_files
from checkpoint.planner import FsdpSavePlanner
from checkpoint.reader import DirectReader
from checkpoint.save_errors import raise_on_every_rank, raise_unwrapped, unwrap_dcp_error
from checkpoint.storage import FsdpWriter, quiet_single_process

__all__ = ["CheckpointCorruptError", "LoadReport", "OpenCheckpoint", "load_state_dict", "open_checkpoint", "save_state_dict"]

logger = logging.getLogger(__name__)

VERIFY_MODES = ("none", "sizes", "full")


class CheckpointCorruptError(ValueError):
    """A committed checkpoint whose files do not match its manifest (truncated, corrupt, missing)."""


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
        for label, keys in (("missing", self.missing_keys), ("unexpected", self.unexpected_keys), ("mis-shaped", self.mismatched_keys)):
            if keys:
                shown = ", ".join(keys[:10]) + (f", ... ({len(keys)} in all)" if len(keys) > 10 else "")
                parts.append(f"{label}: {shown}")
        return "; ".join(parts)


def _dist_info(process_group) -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group), True
    return 0, 1, False


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
    from checkpoint.async_save import wait_for_async_save

    wait_for_async_save()
    write_state_dict(state_dict, path, mode=mode, max_chunk_bytes=max_chunk_bytes, process_group=process_group)


def write_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    mode: str = "collective",
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """:func:`save_state_dict` without waiting for an async save (what the async writer thread runs)."""
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
                _save_collective(state_dict, path, world_size, max_chunk_bytes, convert, prepare, process_group, distributed)
        except BaseException as exc:
            if prepared:
                remove_staging(path)  # every rank has stopped writing: DCP / agree() raised on all of them
            if not isinstance(exc, CheckpointException):
                raise
            raise_unwrapped(exc, path, rank if distributed else 0)


def _save_collective(state_dict, path, world_size, max_chunk_bytes, convert, prepare, process_group, distributed) -> None:
    """DCP's collective save; conversion and rank 0's preparation run in its local-plan step, where it gathers errors."""
    info = {"mode": "collective", "max_chunk_bytes": max_chunk_bytes}
    writer = FsdpWriter(staging_path(path), prepare=prepare, on_commit=partial(_commit_collective, path, world_size, info))
    with quiet_single_process():
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=FsdpSavePlanner(convert=convert),
            process_group=process_group,
            no_dist=not distributed,
        )


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


@contextlib.contextmanager
def _own_errors(path: Path):
    """A single-process DCP call raising the error it hit, not DCP's ``CheckpointException`` (a ``BaseException``)."""
    try:
        yield
    except CheckpointException as exc:
        raise_unwrapped(exc, path)


@dataclass
class OpenCheckpoint:
    """A committed checkpoint opened for reading: where it is, its manifest and DCP metadata."""

    path: Path
    manifest: Manifest | None
    """None for a plain DCP directory opened with ``require_manifest=False``"""
    metadata: Metadata


def open_checkpoint(
    path: str | os.PathLike, *, verify: str = "sizes", require_manifest: bool = True
) -> OpenCheckpoint:
    """Find, validate and read the metadata of the checkpoint at ``path`` (no communication).

    ``verify``: ``"sizes"`` (default) checks every file's size and the CRC-32 of
    ``.metadata``; ``"full"`` also the CRC-32 of every data file (reads them
    all); ``"none"`` checks nothing. ``require_manifest=False`` also opens a
    plain DCP directory (``.metadata``, no manifest: e.g. written by
    ``dcp.save``), unchecked. Raises ``FileNotFoundError``,
    :class:`~checkpoint.manifest.NotACheckpointError` or
    :class:`CheckpointCorruptError` naming the path / file.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    src = resolve_for_load(path)
    manifest = None
    if require_manifest or not (src / METADATA_NAME).is_file() or is_committed(src):
        check_committed(src)
        manifest = read_manifest(src)
    else:
        logger.warning("%s has no manifest: reading it as a plain DCP checkpoint, without file checks", src)
    if verify != "none" and manifest is not None:
        problems = verify_files(src, manifest, checksums=verify == "full")
        md_record = manifest.files.get(METADATA_NAME)
        if not problems and verify == "sizes" and md_record is not None:
            if checksum_file(src / METADATA_NAME).crc32 != md_record.crc32:
                problems.append(f"{src / '.metadata'}: CRC-32 does not match the manifest (the file is corrupt)")
        if problems:
            raise CheckpointCorruptError(f"checkpoint {str(src)!r} is damaged: " + "; ".join(problems))
    try:
        with open(src / METADATA_NAME, "rb") as f:
            metadata = pickle.load(f)
    except Exception as exc:  # any unpickling failure means the file is damaged
        raise CheckpointCorruptError(f"{src / '.metadata'}: cannot be read ({exc!r})") from exc
    return OpenCheckpoint(src, manifest, metadata)


def load_flat(
    opened: OpenCheckpoint,
    targets: dict[str, Any],
    *,
    strict: bool,
    optional: set[str] = frozenset(),
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
        with quiet_single_process(), _own_errors(opened.path):
            dcp.load(
            loadable,
                # Our own files are read straight into place; a plain DCP directory the DCP way.
                storage_reader=DirectReader(opened.path, opened.metadata, direct=opened.manifest is not None),
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True),
                no_dist=True,
            )
    values = {k: v for k, v in loadable.items() if not isinstance(v, torch.Tensor)}
    return report, values


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
    verify: str = "sizes",
    require_manifest: bool = True,
) -> LoadReport:
    """Fill ``state_dict`` from the checkpoint at ``path``: tensors in place, other values replaced.

    Works at any world size and layout; no communication. Keys are the dotted
    paths of the nested dict (``{"model": {"w": t}}`` is ``model.w``).
    ``strict`` raises ``ValueError`` naming missing / unexpected (within the
    top-level sections given) / mis-shaped keys; otherwise they are skipped and
    returned in the :class:`LoadReport`. ``verify`` / ``require_manifest``: see :func:`open_checkpoint`.
    A Stateful value (``state_dict()`` / ``load_state_dict()``: a module, a
    dataloader), as ``dcp.load`` accepts, is filled through its ``state_dict()``
    and then given it by ``load_state_dict()``.
    """
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

