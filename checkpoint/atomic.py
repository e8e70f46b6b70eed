"""Where a save is staged, who may write a path, and how a save replaces a previous checkpoint, crash-safely.

A save to ``P`` holds ``P``'s write lock (:func:`write_lock`: a lock shared by
the threads of this process plus ``fcntl.flock`` on ``.P.fsdp-ckpt-lock`` in
``P``'s parent, shared with other processes), so two saves to one path never
interleave: the second waits for the first. It writes everything under the
staging directory ``.P.fsdp-ckpt-staging`` (marker file first, then data
files, ``.metadata``, and ``manifest.json`` last) and is then swapped into place:

1. if ``P`` holds a committed checkpoint: mark it, ``rename(P, .P.fsdp-ckpt-old)``;
2. ``rename(staging, P)``; fsync the parent directory; remove the marker from ``P``;
3. remove ``.P.fsdp-ckpt-old``.

The path is normalised once where a save or tool starts (:func:`output_path`):
``sub/..`` is the directory it resolves to, and the current directory (or one
holding it) is refused. A committed checkpoint holding files its manifest does
not list (a ``NOTES.md``, a folder) is refused as a target, naming them
(:func:`check_target`): the swap replaces the whole directory and would delete them.

Staging and swap directories are recognisably ours: a name no user would
pick, and the marker file :data:`MARKER_NAME` inside, written before anything
else. A save removes only marked directories; anything unmarked sitting at
one of these names, and any symbolic link there (never followed, whatever it
points to), is left alone and the save fails with ``FileExistsError`` saying
what is in the way. Whatever the user keeps next
to ``P`` (``P.old``, ``P.tmp``, backups) is never looked at.

A ``kill -9`` at any moment leaves one of these states, each resolved without
ever mixing files of two saves:

* before 1: ``P`` is the previous checkpoint (the staging dir is ignored,
  and removed by the next save);
* between 1 and 2: ``P`` is missing and the swap dir holds the previous
  checkpoint: :func:`resolve_for_load` falls back to it (with a warning), and
  the next save renames it back first;
* after 2: ``P`` is the new checkpoint; a leftover swap dir is removed by the next save.

A fresh path never exists before step 2, so it is either complete or absent
(``FileNotFoundError`` that mentions an unfinished save if there is one).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from checkpoint.errors import some_of
from checkpoint.manifest import MANIFEST_NAME, METADATA_NAME, NotACheckpointError, read_manifest
from checkpoint.storage_backend import FileStat, Storage, locate, storage_for

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "MARKER_NAME",
    "check_target",
    "is_committed",
    "is_ours",
    "make_staging",
    "old_path",
    "output_path",
    "remove_staging",
    "resolve_for_load",
    "staging_path",
    "swap_into_place",
    "write_lock",
]

logger = logging.getLogger(__name__)

STAGING_SUFFIX = ".fsdp-ckpt-staging"
OLD_SUFFIX = ".fsdp-ckpt-old"
LOCK_SUFFIX = ".fsdp-ckpt-lock"
MARKER_NAME = ".fsdp-ckpt-owned"
"""The file inside every directory this library stages or swaps: it may remove such a directory, and no other."""


def output_path(path: str | os.PathLike, storage_options: dict | None = None) -> Path:
    """``path`` as a save or a tool's output names it, normalised once at the entry point.

    A path ending in ``..`` (``sub/..``) becomes the directory it resolves to: the
    staging and swap names are siblings derived from the last component, and
    ``sub/....fsdp-ckpt-staging`` would sit inside the target itself. The current
    directory, or one holding it (``.``, ``/``, a ``sub/..`` that resolves there), is
    refused with ``ValueError``: a save replaces its target by renaming it away.
    """
    given = path
    located = locate(path, storage_options)
    if not isinstance(located, Path):
        return located  # a URL: no current directory to protect, no ".." to resolve
    path = Path(located)  # drops "." components and a trailing "/"
    if path.name in ("", ".."):
        path = Path(os.path.abspath(path))  # as the shell reads it (a link named at the target is refused later)
    cwd = Path.cwd()
    if Path(os.path.abspath(path)) in (cwd, *cwd.parents):
        raise ValueError(
            f"cannot write to {os.fspath(given)!r} ({path}): it is the current directory or holds it, and a save "
            "or export replaces its target by renaming it; name a directory of its own, e.g. "
            f"{str(cwd / 'checkpoint')!r}"
        )
    return located if path == located else locate(path)  # bound to its storage, resolved once


def _sibling(path: str | os.PathLike, suffix: str) -> Path:
    path = locate(path)
    if path.name in ("", ".."):
        # never derived from such a name: it would nest inside the target (see output_path)
        raise ValueError(f"{str(path)!r} is not a path to save to; name the output directory itself")
    return path.with_name(f".{path.name}{suffix}")


def staging_path(path: str | os.PathLike) -> Path:
    """Where a save to ``path`` is written before it is swapped in (same directory: the rename is atomic)."""
    return _sibling(path, STAGING_SUFFIX)


def old_path(path: str | os.PathLike) -> Path:
    """Where the checkpoint a save replaces sits between the two renames of the swap."""
    return _sibling(path, OLD_SUFFIX)


def lock_path(path: str | os.PathLike) -> Path:
    return _sibling(path, LOCK_SUFFIX)


def _is(path: Path, kind: str) -> bool:
    """Whether ``path`` (a link followed, as ``Path.is_file`` / ``is_dir`` do) is a ``kind``."""
    found = storage_for(path).stat(path, follow_symlinks=True)
    return found is not None and found.kind == kind


def _exists(path: Path) -> bool:
    """``Path.exists``: something at ``path``, a link followed."""
    return storage_for(path).stat(path, follow_symlinks=True) is not None


def _absent(path: Path) -> bool:
    """Nothing at all at ``path``, not even a dangling link."""
    return storage_for(path).stat(path) is None


def _is_empty_dir(path: Path) -> bool:
    return _is(path, "directory") and not storage_for(path).list(path)


def is_committed(path: str | os.PathLike) -> bool:
    return _is(locate(path) / MANIFEST_NAME, "file")


def is_ours(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a directory (not a link to one) carrying this library's marker (see the module
    docstring): a link at a name the library removes is never followed, so a save cannot empty what it points to."""
    directory = locate(directory)
    store = storage_for(directory)
    found, marker = store.stat(directory), store.stat(directory / MARKER_NAME)
    return found is not None and found.kind == "directory" and marker is not None and marker.kind == "file"


def mark(directory: str | os.PathLike, *, fresh: bool = False) -> None:
    """Write the marker into ``directory`` (durably: a crash right after must still find it); ``fresh``: the
    directory was just made under a new name, so no marker can be there yet (one request less on an object store)."""
    marker = locate(directory) / MARKER_NAME
    if fresh or not _is(marker, "file"):
        store = storage_for(marker)
        stream = store.create(marker)
        try:
            stream.write(b"written by fsdp-ckpt; this directory may be replaced or removed by the next save\n")
        except BaseException:
            stream.abort()
            raise
        stream.finish()
        store.sync_dir(directory)


def _in_the_way(path: Path, role: str, target: Path) -> FileExistsError:
    return FileExistsError(
        f"{str(path)!r} is in the way of the save to {str(target)!r}: this name is kept for its {role}, "
        f"but it has no {MARKER_NAME} marker, so it was not made by a save and is left alone; move it away"
    )


def _remove_marked(directory: Path) -> None:
    """Remove the marked ``directory``, its marker last.

    A kill midway then leaves it still marked (or empty), which the next save
    recognises as its own and removes; a whole-tree removal could take the
    marker first and leave files that block every later save.
    """
    store = storage_for(directory)
    for name in store.list(directory):
        if name != MARKER_NAME:
            found = store.stat(directory / name)
            if found is not None and found.kind == "directory":
                store.remove_tree(directory / name)
            else:
                store.delete(directory / name, missing_ok=True)
    store.delete(directory / MARKER_NAME, missing_ok=True)
    store.remove_dir(directory)


def _link_in_the_way(path: Path, found: FileStat, role: str, target: Path) -> FileExistsError:
    return FileExistsError(
        f"{str(path)!r} is a symbolic link (to {found.link_target!r}), in the way of the save to {str(target)!r}: "
        f"this name is kept for its {role}, which a save removes, and a save never follows a link there "
        "(it would remove what the link points to); move the link away"
    )


def _refuse_links(path: Path) -> None:
    """Refuse a link at the staging or swap name of ``path``: a save removes what sits there."""
    for name, role in ((staging_path(path), "unfinished saves"), (old_path(path), "interrupted swaps")):
        found = storage_for(name).stat(name)
        if found is not None and found.kind == "symlink":
            raise _link_in_the_way(name, found, role, path)


def _remove_ours(directory: Path, role: str, target: Path) -> None:
    """Remove ``directory`` if it is ours (marked, or an empty dir left by a kill before the marker)."""
    found = storage_for(directory).stat(directory)
    if found is None:
        return
    if found.kind == "symlink":
        raise _link_in_the_way(directory, found, role, target)
    if found.kind == "directory":
        if is_ours(directory):
            _remove_marked(directory)
            return
        if not storage_for(directory).list(directory):
            storage_for(directory).remove_dir(directory)
            return
    raise _in_the_way(directory, role, target)


def make_staging(path: str | os.PathLike, *, fresh: bool = True) -> Path:
    """An empty, marked staging directory for a save to ``path``. Precondition: the caller holds :func:`write_lock`.

    A staging directory left by an unfinished save is removed first (``fresh``)
    or reused as is (``fresh=False``: ranks written one by one, :func:`checkpoint.write_rank`).
    Raises ``FileExistsError`` when something not made by a save sits at the staging name, or ``path``
    is a symbolic link (a save replaces what sits at ``path``: the link, not its target).
    """
    path = locate(path)
    found = storage_for(path).stat(path)
    if found is not None and found.kind == "symlink":
        # The swap renames whatever sits at ``path``: it would move the link aside, not replace what it points to.
        raise FileExistsError(
            f"cannot save to {str(path)!r}: it is a symbolic link (to {found.link_target!r}), which a save would "
            f"replace by a directory; save to {found.real_path!r} itself, or to another path"
        )
    staged = staging_path(path)
    if fresh or not is_ours(staged):
        _remove_ours(staged, "unfinished saves", path)
    storage_for(staged).make_dir(staged)
    mark(staged)
    return staged


def remove_staging(path: str | os.PathLike) -> None:
    """Remove the staging directory of a failed save to ``path``, if it is ours. Never raises."""
    staged = staging_path(path)
    if is_ours(staged):
        with contextlib.suppress(OSError):
            _remove_marked(staged)


def check_target(path: str | os.PathLike) -> None:
    """Refuse, before anything is written, a ``path`` a save may not replace.

    ``path`` may be absent, an empty directory or a committed checkpoint holding
    only its own files. Raises ``FileExistsError`` naming it (or the files the user
    put inside it) otherwise: user data is never replaced; or naming a symbolic link at the
    staging or swap name.
    """
    path = locate(path)
    _refuse_links(path)
    if _absent(path):
        return
    if _is(path, "directory") and is_committed(path):
        _refuse_foreign_files(path)
        return
    if _is_empty_dir(path):
        return
    kind = "a file" if not _is(path, "directory") else "a directory that is not a committed checkpoint"
    raise FileExistsError(f"cannot save to {str(path)!r}: it is {kind}; move it away or save to another path")


def _refuse_foreign_files(path: Path) -> None:
    """``FileExistsError`` naming what the user put inside committed checkpoint ``path``.

    A save replaces the whole directory (renamed aside, then removed), so it would
    delete them; carrying them over instead would mean copying arbitrary user data
    into every save. The checkpoint's own files are those its manifest lists; when
    the manifest cannot be read, those named as the writers name them.
    """
    try:
        own = set(read_manifest(path).files)
    except (OSError, ValueError):  # a damaged manifest: the save replacing it is welcome
        own = None
    store = storage_for(path)
    foreign = sorted(
        name
        for name in store.list(path)
        if name not in (MANIFEST_NAME, MARKER_NAME) and not (name in own if own is not None else _written_name(name))
    )
    if foreign:
        raise FileExistsError(
            f"cannot save to {str(path)!r}: it holds files that are not part of the checkpoint ({some_of(foreign)}), which "
            "the save would delete (it replaces the whole directory); move them out, or save to another path"
        )


def _written_name(name: str) -> bool:
    return name == METADATA_NAME or name.endswith((".distcp", ".rank.json"))


_registry_lock = threading.Lock()
_thread_locks: dict[str, list] = {}  # absolute path -> [lock, users]


DEFAULT_LOCK_TIMEOUT = 300.0
"""Seconds a save waits for another save holding its path's write lock before it gives up
(``lock_timeout=``): below the default process-group timeouts, so in a job every rank raises the lock's
error rather than a collective timing out."""


@contextlib.contextmanager
def write_lock(path: str | os.PathLike, *, timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> Iterator[None]:
    """Hold the right to write ``path``: other threads and processes saving to it wait until it is released.

    Two locks, taken in this order: one per path for this process's threads
    (``flock`` alone would not order two threads sharing a lock file), then
    the storage's :meth:`~checkpoint.storage_backend.Storage.lock` on
    ``.P.fsdp-ckpt-lock`` beside ``path`` for other processes (local:
    ``fcntl.flock``; on file systems where ``flock`` is not shared between
    hosts, only processes of one host are ordered). ``timeout``: seconds to wait
    for them together, then ``TimeoutError`` naming the lock file and its holder;
    ``None`` waits as long as it takes.
    """
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"lock_timeout must be None (wait as long as it takes) or seconds >= 0, got {timeout!r}")
    path = locate(path)
    deadline = None if timeout is None else time.monotonic() + timeout
    key = os.path.abspath(path)
    with _registry_lock:
        entry = _thread_locks.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1  # users: the entry is dropped with its last one, so the registry stays small
    thread_lock = entry[0]
    try:
        _acquire_thread_lock(thread_lock, path, timeout)
        try:
            store = storage_for(path)
            try:
                store.make_dir(path.parent)
            except (FileExistsError, NotADirectoryError) as exc:
                raise NotADirectoryError(
                    f"cannot save to {str(path)!r}: a parent of it is a file, not a directory"
                ) from exc
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.ExitStack() as held:
                try:
                    held.enter_context(_store_lock(store, lock_path(path), left))
                except TimeoutError as exc:
                    raise TimeoutError(f"cannot save to {str(path)!r}: {exc}; nothing was written") from None
                yield
        finally:
            thread_lock.release()
    finally:
        with _registry_lock:
            entry[1] -= 1
            if entry[1] == 0:
                del _thread_locks[key]


def _store_lock(store: Storage, path: Path, timeout: float | None) -> contextlib.AbstractContextManager[None]:
    """``store.lock(path, timeout=timeout)``; a Storage written before ``lock`` took ``timeout`` is still
    used, waiting without one (said once per class), rather than failing every save with a TypeError."""
    if _lock_takes_timeout(type(store)):
        return store.lock(path, timeout=timeout)
    return store.lock(path)


@functools.cache
def _lock_takes_timeout(kind: type) -> bool:
    if "timeout" in inspect.signature(kind.lock).parameters:  # type: ignore[attr-defined]
        return True
    logger.warning(
        "%s.lock(path) takes no timeout: saves through it wait for another holder as long as it takes, "
        "whatever lock_timeout says; give it a keyword `timeout: float | None = None` (checkpoint.Storage.lock)",
        kind.__qualname__,
    )
    return False


def _acquire_thread_lock(thread_lock: threading.Lock, path: Path, timeout: float | None) -> None:
    if thread_lock.acquire(blocking=False):
        return
    logger.info("waiting for another save to %s in this process to finish", path)
    if not thread_lock.acquire(timeout=-1 if timeout is None else timeout):
        raise TimeoutError(
            f"cannot save to {str(path)!r}: gave up after {timeout:g} s waiting for another save to it in this "
            "process (another thread) to finish; let it finish, or wait longer (lock_timeout=..., None waits as "
            "long as it takes); nothing was written"
        )


def recover_interrupted_swap(path: str | os.PathLike, *, complete: Callable[[Path], bool] = is_committed) -> None:
    """Undo a swap killed between its two renames: the swap dir goes back to ``P``. Rank 0 / one process only.

    ``complete`` tells a finished output (default: a committed checkpoint), as in :func:`swap_into_place`.
    """
    path, old = locate(path), old_path(path)
    if not _exists(path) and is_ours(old) and complete(old):
        logger.warning("recovering %s from %s left by an interrupted save", path, old)
        storage_for(path).rename(old, path)
        storage_for(path).sync_dir(path.parent)


def swap_into_place(
    staged: str | os.PathLike, path: str | os.PathLike, *, complete: Callable[[Path], bool] = is_committed
) -> None:
    """Replace ``path`` by the committed directory ``staged`` (see the module docstring).

    One process only, holding :func:`write_lock`. ``complete(directory)`` says
    whether a directory holds a finished output: by default a committed
    checkpoint; other writers (``fsdp-ckpt export``) pass their own commit
    record. ``staged`` must be complete and marked. Raises ``FileExistsError``
    when ``path`` exists but is not complete (and not empty), or an unmarked
    directory sits at the swap name: user data this function will not delete.
    """
    staged, path, old = locate(staged), locate(path), old_path(path)
    assert complete(staged) and is_ours(staged), f"{staged} must be committed and marked before it is swapped in"
    recover_interrupted_swap(path, complete=complete)
    store = storage_for(path)
    if _exists(path):
        if complete(path):
            _remove_ours(old, "interrupted swaps", path)  # a leftover of a finished swap; P itself is complete
            mark(path)  # so that a kill between the renames leaves a swap dir the next save recognises
            store.rename(path, old)
        elif _is_empty_dir(path):
            store.remove_dir(path)
        else:
            raise FileExistsError(
                f"{str(path)!r} exists and is not a committed checkpoint; refusing to replace it "
                "(move it away or save to another path)"
            )
    store.rename(staged, path)
    store.sync_dir(path.parent)
    # The output holds only its own files; the marker comes back if a later save moves it aside.
    store.delete(path / MARKER_NAME, missing_ok=True)
    if is_ours(old):  # moved there (and marked) by this very call
        with contextlib.suppress(OSError):
            _remove_marked(old)


def resolve_for_load(path: str | os.PathLike) -> Path:
    """The directory to read for a checkpoint saved at ``path``.

    ``path`` itself when it exists; the swap directory when ``path`` is missing
    because a save was killed mid-swap. Raises ``FileNotFoundError`` (naming
    the path, and an unfinished save if there is one) otherwise; a directory
    without a manifest raises :class:`~checkpoint.manifest.NotACheckpointError`
    later, from ``read_manifest``.
    """
    path = locate(path)
    if _exists(path):
        return path
    old = old_path(path)
    if is_ours(old) and is_committed(old):
        logger.warning("%s is missing; loading %s left by a save that was interrupted mid-swap", path, old)
        return old
    hint = ""
    if _exists(staging_path(path)):
        hint = f" ({staging_path(path)} holds an unfinished save; it is not loaded)"
    raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist{hint}")


def check_committed(path: Path) -> None:
    if not is_committed(path):
        raise NotACheckpointError(
            f"{str(path)!r} has no {MANIFEST_NAME}: it is not a committed checkpoint "
            "(a save that did not finish, or a plain DCP directory)"
        )
