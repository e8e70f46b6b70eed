"""Which checkpoints under a root are committed, which is newest, and keeping only the last few.

For local paths and URLs alike, whichever protocol saved them (:mod:`checkpoint.atomic` renames, or
the object-store protocol of :mod:`checkpoint.object_commit`). A checkpoint counts once committed
(its ``manifest.json``, or its head): a save that did not finish is never "latest" and never counted
as kept. Its age is the time its commit record was written.
"""

from __future__ import annotations

import logging
import os
from pathlib import PurePath

from checkpoint.atomic import is_committed
from checkpoint.manifest import MANIFEST_NAME, read_manifest
from checkpoint.object_commit import HEAD_NAME, read_head, remove_unfinished, resolve_for_load
from checkpoint.save_queue import wait_for_async_save, wait_for_saves
from checkpoint.storage_backend import locate, storage_for

__all__ = ["committed_checkpoints", "latest", "retain"]

logger = logging.getLogger(__name__)


def committed_checkpoints(root: str | os.PathLike, *, storage_options: dict | None = None) -> list[PurePath]:
    """The committed checkpoints directly under ``root``, oldest commit first (ties by name)."""
    return [child for _, child in _by_commit_time(locate(root, storage_options))]


def _by_commit_time(root: PurePath) -> list[tuple[float, PurePath]]:
    """(commit time, checkpoint) for each committed checkpoint under ``root``, oldest first, ties by name."""
    store = storage_for(root)
    if store.stat(root) is None:
        return []
    found = []
    for name in store.list(root):
        child = root / name
        when = _committed_at(child)
        if when is not None:
            found.append((when, name, child))
    return [(when, child) for when, _, child in sorted(found)]


def _committed_at(path: PurePath) -> float | None:
    """When the checkpoint at ``path`` was committed, or ``None`` when it holds none."""
    store = storage_for(path)
    record = store.stat(path / HEAD_NAME)
    if record is not None and record.kind == "file":
        head = read_head(path)
        # The head's own clock in ns: an object store's LastModified has whole seconds, so two commits in
        # one second would otherwise be ordered by name.
        if head is not None and head.committed_ns is not None:
            return head.committed_ns / 1e9
    elif is_committed(path):
        record = store.stat(path / MANIFEST_NAME)
    if record is None or record.kind != "file":
        return None
    return record.modified if record.modified is not None else 0.0


def _tied(found: list[tuple[float, PurePath]], at: int) -> list[PurePath]:
    """The checkpoints committed at the same time as ``found[at]``, itself included."""
    return [child for when, child in found if when == found[at][0]]


def latest(root: str | os.PathLike, *, storage_options: dict | None = None) -> PurePath | None:
    """The newest committed checkpoint under ``root`` (a local directory or a URL), or ``None``.

    A save still running, killed or failed is never returned: only what a load would accept.
    """
    found = _by_commit_time(locate(root, storage_options))
    if not found:
        return None
    tied = _tied(found, -1)
    if len(tied) > 1:
        logger.warning(
            "latest: %s were committed at the same time as far as the storage records it (a clock or file "
            "system with coarse times); taking %s, the last by name: pass the checkpoint path explicitly if "
            "that is not the newest",
            ", ".join(map(str, tied)),
            found[-1][1],
        )
    return found[-1][1]


def retain(
    root_or_path: str | os.PathLike, *, keep_last: int, storage_options: dict | None = None, wait: bool = True
) -> list[PurePath]:
    """Delete all but the ``keep_last`` newest committed checkpoints beside ``root_or_path`` (a checkpoint:
    its siblings; a directory holding checkpoints: its children). Returns what was deleted.

    Never deletes the newest one, anything not committed (a save in progress), nor anything that is
    not a checkpoint; inside a deleted checkpoint only what the save wrote is removed (files a user put
    there stay). ``wait``: first wait for this process's async saves being staged or in flight (one may be
    about to commit a checkpoint, or be writing into one that would be deleted); ``False`` only from the
    save's own writer, after its commit (``keep_last``).
    """
    if keep_last < 1:
        raise ValueError(
            f"keep_last must be at least 1 (the newest committed checkpoint is never deleted), got {keep_last}"
        )
    if wait:
        wait_for_saves("retention deletes old checkpoints")
        wait_for_async_save()  # an unobserved failure of that save is raised here, as by the next save
    path = locate(root_or_path, storage_options)
    root = path.parent if _committed_at(path) is not None else path
    found = _by_commit_time(root)
    cut = max(len(found) - keep_last, 0)
    doomed = [child for _, child in found[:cut]]
    if cut:
        # Never delete what might be newer than a kept checkpoint: ties with the oldest kept one stay.
        spared = [child for child in _tied(found, cut) if child in doomed]
        if spared:
            logger.warning(
                "retention: keeping %s too: committed at the same time as %s as far as the storage records it, "
                "so which is newer is unknown",
                ", ".join(map(str, spared)),
                found[cut][1],
            )
            doomed = [child for child in doomed if child not in spared]
    for checkpoint in doomed:
        _delete(checkpoint)
        logger.info("retention: deleted %s (keeping the %d newest)", checkpoint, keep_last)
    return doomed


def _delete(path: PurePath) -> None:
    """Remove one committed checkpoint, its commit record first (a kill midway leaves it uncommitted)."""
    store = storage_for(path)
    head = read_head(path)
    if head is not None:
        store.delete(path / HEAD_NAME)
        # every save directory, now that none is committed, but for one another process is writing (its lease)
        remove_unfinished(path, replaced=head.sequence)
        return
    directory = resolve_for_load(path)
    listed = sorted(read_manifest(directory).files)
    store.delete(directory / MANIFEST_NAME)
    for name in listed:
        store.delete(directory / name, missing_ok=True)
    if not store.list(directory):
        store.remove_dir(directory)
