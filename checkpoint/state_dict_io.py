"""Save and load nested state dicts in the ``fsdp_dtensor`` format.

:func:`save_state_dict` and :func:`load_state_dict` are the layer under
:func:`checkpoint.save` / :func:`checkpoint.load`; they take any nested dict
of tensors, DTensors, flat-shard tensors (with a ``fsdp_shard_spec``),
:func:`checkpoint.shard` objects and picklable values.

Communication: a save in the default ``mode="collective"`` costs DCP's fixed
plan exchange (a gather and a scatter) and its final gather + broadcast,
whatever the number of tensors; ``mode="scale"`` costs one barrier (rank 0
then merges the per-rank metadata, :func:`checkpoint.commit.commit`). A load
costs nothing: every rank reads the merged ``.metadata`` and its own chunks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.atomic import staging_path
from checkpoint.commit import DEFAULT_MAX_CHUNK_BYTES, commit, commit_staged
from checkpoint.convert import convert_tree, to_checkpointable
from checkpoint.opener import (
    CheckpointCorruptError,
    OpenCheckpoint,
    open_checkpoint,
    read_failure,
)
from checkpoint.planner import FsdpSavePlanner
from checkpoint.reader import DirectReader
from checkpoint.safe_unpickle import SafeLoadPlanner, check_saved_values
from checkpoint.storage import FsdpWriter, quiet_single_process

__all__ = ["CheckpointCorruptError", "LoadReport", "OpenCheckpoint", "load_state_dict", "open_checkpoint", "save_state_dict"]

logger = logging.getLogger(__name__)

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
    (see :mod:`checkpoint.atomic`). ``mode="scale"`` trades DCP's plan exchange
    for one barrier; in it, plain tensors are taken from rank 0 and the
    checkpoint is committed when rank 0 returns.
    """
    if mode not in ("collective", "scale"):
        raise ValueError(f"mode must be 'collective' or 'scale', got {mode!r}")
    check_saved_values(state_dict)  # before anything is written: what we save must load weights-only
    rank, world_size, distributed = _dist_info(process_group)
    scale = mode == "scale" and distributed
    converted = convert_tree(state_dict, rank=rank, replicas_on_rank0_only=scale, max_chunk_bytes=max_chunk_bytes)
    staged = staging_path(path)
    info = {"max_chunk_bytes": max_chunk_bytes}
    if scale:
        writer = FsdpWriter(staged, world_size=world_size)
        dcp.save(
            converted,
            storage_writer=writer,
            planner=FsdpSavePlanner(validate_cover=False),
            process_group=process_group,
            use_collectives=False,
        )  # ends with DCP's one barrier: every rank's files are durable past it
        if rank == 0:
            commit(path, world_size, extra_info=info)
        return
    on_commit = partial(_commit_collective, path, world_size, {"mode": "collective", **info})
    writer = FsdpWriter(staged, on_commit=on_commit)
    with quiet_single_process():
        dcp.save(
            converted,
            storage_writer=writer,
            planner=FsdpSavePlanner(),
            process_group=process_group,
            no_dist=not distributed,
        )


def _commit_collective(path, world_size, info, metadata: Metadata, files) -> None:
    commit_staged(path, metadata, files, world_size, extra_info=info)


def load_flat(
    opened: OpenCheckpoint,
    targets: dict[str, Any],
    *,
    strict: bool,
    optional: set[str] = frozenset(),
    scope: tuple[str, ...] = ("",),
) -> tuple[LoadReport, dict[str, Any]]:
    """Fill flat ``targets`` (dotted key -> tensor / placeholder) from ``opened``; tensors in place.

    Returns the report and the loaded non-tensor values by key. ``optional``
    keys are never reported missing; only checkpoint keys starting with one of
    ``scope`` count as unexpected. Strict: raises ``ValueError`` naming every
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
    report.unexpected_keys = [k for k in saved if k not in targets and k.startswith(scope)]
    if strict and report:
        raise ValueError(f"checkpoint {str(opened.path)!r} does not match what is being loaded: {report.describe()}")
    if loadable:
        check = opened.content_check()
        try:
            with quiet_single_process():
                dcp.load(
                    loadable,
                    # Our own files are read straight into place; a plain DCP directory the DCP way.
                    storage_reader=DirectReader(opened.path, opened.metadata, direct=opened.manifest is not None, check=check),
                    planner=SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False,
                                            allow_partial_load=True, where=str(opened.path)),
                    no_dist=True,
                )
        except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            raise read_failure(exc, opened.path) from None
        if check is not None:
            check.finish()  # raises naming the file whose bytes did not match
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
    verify: str = "crc",
    require_manifest: bool = True,
) -> LoadReport:
    """Fill ``state_dict`` from the checkpoint at ``path``: tensors in place, other values replaced.

    Works at any world size and layout; no communication. Keys are the dotted
    paths of the nested dict (``{"model": {"w": t}}`` is ``model.w``).
    ``strict`` raises ``ValueError`` naming missing / unexpected (within the
    top-level sections given) / mis-shaped keys; otherwise they are skipped and
    returned in the :class:`LoadReport`. ``verify`` / ``require_manifest``: see :func:`open_checkpoint`.
    """
    opened = open_checkpoint(path, verify=verify, require_manifest=require_manifest)
    flat, mappings = flatten_state_dict(state_dict)
    scope = tuple(f"{k}." for k in state_dict)
    report, values = load_flat(opened, flat, strict=strict, scope=scope)
    for key, value in values.items():
        set_element(state_dict, mappings[key], value)
    return report

