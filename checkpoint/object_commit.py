"""How a save commits where nothing can be renamed or locked: object stores and shared file systems.

A storage whose ``renames_atomically`` is ``False`` (every URL,
:class:`~checkpoint.fsspec_storage.FsspecStorage`; a shared file system mounted
with :class:`~checkpoint.storage_backend.SharedFileSystemStorage`) gets this
protocol instead of :mod:`checkpoint.atomic`'s staging + rename. A checkpoint
at ``P`` is then:

* ``P/fsdp-save-<sequence>-<random>/``: one save, an ordinary checkpoint
  directory (the marker :data:`~checkpoint.atomic.MARKER_NAME` first, data
  objects, ``.metadata``, its ``manifest.json`` last). Every save writes a new
  one: nothing a reader may be reading is ever overwritten;
* ``P/`` :data:`HEAD_NAME`: the commit record, one small JSON object naming
  the committed save (``{"format", "save", "sequence", "committed_ns"}``). Writing it is the
  commit: a reader finds the checkpoint through it and never sees a save whose
  head was not written; the previous save stays loadable until then.

One writer per URL, without a lock: a save reads the head first, and writes
the new one only if the head is still the one it read
(:meth:`~checkpoint.storage_backend.Storage.put_if`: S3's conditional PUT,
``If-Match`` / ``If-None-Match: *``). Of two saves racing on one URL the first
to commit wins; the other fails with :class:`ConcurrentSaveError` and removes
its own objects. Nothing ever mixes: each save's objects are under its own id.

After its commit a save removes the saves it replaced: every save directory
of ``P`` whose sequence is at most its own, but for itself. A save still
writing with such a sequence started before this commit, read the old head,
and can no longer commit. A killed save leaves only its own save directory,
which the next committed save (or ``fsdp-ckpt gc``) removes, aborting the multipart uploads it left
unfinished there (stored, and billed, though no listing shows them). Nothing else
under ``P`` is ever touched: only names of the save pattern that carry the marker
(``gc`` also those of the pattern without one).

A save in progress holds a **lease**: its marker is a small JSON record
(``{"save", "pid", "host", "renewed_ns", "lease_s"}``) written first, and renewed
every ``lease_s / 3`` seconds while the save runs. ``fsdp-ckpt gc`` and retention,
from any process, leave alone a save directory (or a commit claim) whose lease is
held: by a live process on this host (its pid), or renewed within ``lease_s`` by
a process on another host (its clock against ours: hosts must agree to within a
small part of :data:`LEASE_S`). A killed save's lease is stale at once on its own
host, after ``lease_s`` elsewhere; ``gc --force`` ignores leases. A save directory whose
sequence is at most the head's read an older head and can never commit: no lease
keeps it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import NoReturn

from checkpoint.atomic import (
    DEFAULT_LOCK_TIMEOUT,
    MARKER_NAME,
    check_target,
    is_committed,
    is_ours,
    make_staging,
    remove_staging,
    staging_path,
    swap_into_place,
    write_lock,
)
from checkpoint.atomic import resolve_for_load as resolve_renamed
from checkpoint.errors import CheckpointCorruptError
from checkpoint.manifest import MANIFEST_NAME
from checkpoint.save_queue import wait_for_saves
from checkpoint.storage_backend import Storage, VersionConflict, locate, storage_for

__all__ = [
    "CLAIM_PREFIX",
    "HEAD_NAME",
    "LEASE_S",
    "ConcurrentSaveError",
    "Head",
    "SaveProtocol",
    "collect_garbage",
    "is_checkpoint",
    "protocol_for",
    "read_head",
    "remove_unfinished",
    "resolve_for_load",
]

logger = logging.getLogger(__name__)

HEAD_NAME = "fsdp-ckpt-head.json"
"""The commit record of a checkpoint saved by the object-store protocol."""
CLAIM_PREFIX = "fsdp-ckpt-claim-"
"""``<prefix><the save the head names, or "first">``: held (created only if absent, removed after) by the save
replacing that head, on stores without a conditional write (``Storage.conditional_put`` false: a shared file
system, ``file://``, ``memory://``). One name per head replaced: a claim left by a save killed after its head
was written names a head no save replaces any more, and does not block the next one."""
_CLAIM = re.compile(r"fsdp-ckpt-claim-(fsdp-save-\d{8,}-[0-9a-f]{12}|first)\Z")
_SAVE = re.compile(r"fsdp-save-(\d{8,})-[0-9a-f]{12}\Z")
_HEAD_BYTES = 1 << 16
LEASE_S = 300.0
"""Seconds a save's lease stays held without renewal, for processes on other hosts (see the module docstring)."""


class ConcurrentSaveError(FileExistsError):
    """Another save committed the same path while this one was writing; this one's objects were removed."""


@dataclass(frozen=True)
class Head:
    """What a checkpoint's head says, and the version of the head object it was read from."""

    save: str
    sequence: int
    version: Hashable
    committed_ns: int | None = None
    """the committing host's clock at the commit, in ns (``None`` in heads written before it was recorded):
    retention orders checkpoints by it, since an object store's LastModified has whole seconds"""


def read_head(path: PurePath) -> Head | None:
    """The head of the checkpoint at ``path``, or ``None`` when it has none (absent, or saved by renames)."""
    where = path / HEAD_NAME
    found = _read_versioned(storage_for(path), where, _HEAD_BYTES + 1)
    if found is None:
        return None
    raw, version = found
    try:
        data = json.loads(raw)
        save, sequence = data["save"], data["sequence"]
        ok = data.get("format") == "fsdp_dtensor" and isinstance(save, str) and _SAVE.match(save)
        if not ok or not isinstance(sequence, int) or int(_SAVE.match(save).group(1)) != sequence:  # type: ignore[union-attr]
            raise ValueError("unexpected fields")
        committed_ns = data.get("committed_ns")
        if committed_ns is not None and (type(committed_ns) is not int or committed_ns < 0):
            raise ValueError(f"committed_ns is {committed_ns!r}, not a non-negative integer")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(
            f"{where}: not a valid commit record ({exc}); restore it from a copy, or remove it and the "
            "checkpoint at this path"
        ) from None
    return Head(save, sequence, version, committed_ns)


def _read_versioned(store: Storage, where: PurePath, limit: int) -> tuple[bytes, Hashable] | None:
    """The bytes at ``where`` (at most ``limit``) and their version, or ``None`` when absent: in one request
    where the storage offers it (``FsspecStorage.read_versioned``: one GET), else a version, then a read."""
    read_versioned = getattr(store, "read_versioned", None)
    if read_versioned is not None:
        return read_versioned(where, limit)
    version = store.version(where)
    if version is None:
        return None
    with store.open_read(where) as f:
        return f.read(limit), version


def resolve_for_load(path: str | os.PathLike) -> Path:
    """The directory to read for the checkpoint at ``path``: the committed save its head names, else
    what :func:`checkpoint.atomic.resolve_for_load` finds (a checkpoint saved by renames)."""
    path = locate(path)
    head = read_head(path)
    if head is not None:
        return path / head.save
    return resolve_renamed(path)


def is_checkpoint(path: PurePath) -> bool:
    """Whether ``path`` holds a committed checkpoint, by either protocol."""
    return storage_for(path).stat(path / HEAD_NAME) is not None or is_committed(path)


def protocol_for(path: str | os.PathLike, *, lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> SaveProtocol:
    """How a save to ``path`` commits: renames where the storage has atomic ones, else the object-store protocol.

    ``lock_timeout``: how long the rename protocol waits for another save's write lock
    (:func:`~checkpoint.atomic.write_lock`); the object-store protocol takes no lock."""
    path = locate(path)
    store = storage_for(path)
    if store.renames_atomically:
        return RenameCommit(path, store, lock_timeout=lock_timeout)
    return ObjectCommit(path, store)


class SaveProtocol:
    """One save's commit protocol; see :class:`RenameCommit` and :class:`ObjectCommit`."""

    needs_agreement = False
    """whether the ranks must learn the staging directory from the preparing rank (a fresh save id)"""
    fresh_staging = False
    """whether :meth:`begin` makes the staging directory under a name never used before, so that it holds only
    what this save writes (nothing to list before the commit)"""

    def __init__(self, path: PurePath, store: Storage) -> None:
        self.path = path
        self.store = store

    def begin(self, held: contextlib.ExitStack) -> PurePath:
        """Hold the right to write, refuse a target that is not a checkpoint, make the staging directory."""
        raise NotImplementedError

    def staged(self, name: str | None = None) -> PurePath:
        """The staging directory, from its ``name`` (what :meth:`begin` returned) where it is per save."""
        raise NotImplementedError

    def publish(self, staged: PurePath) -> None:
        """Make the committed staging directory the checkpoint at the path (precondition: its manifest is written)."""
        raise NotImplementedError

    def abandon(self, staged: PurePath | None) -> None:
        """Remove what a failed save wrote. Never raises."""
        raise NotImplementedError

    def lost(self, staged: PurePath) -> Exception | None:
        """Why a save that failed while writing ``staged`` failed, when another save took its staging away."""
        return None


class RenameCommit(SaveProtocol):
    """:mod:`checkpoint.atomic`: a staging directory beside the path, the swap by renames, an ``flock``."""

    def __init__(self, path: PurePath, store: Storage, *, lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> None:
        super().__init__(path, store)
        self.lock_timeout = lock_timeout

    def begin(self, held: contextlib.ExitStack) -> PurePath:
        held.enter_context(write_lock(self.path, timeout=self.lock_timeout))  # held until committed
        check_target(self.path)
        return make_staging(self.path)

    def staged(self, name: str | None = None) -> PurePath:
        return staging_path(self.path)

    def publish(self, staged: PurePath) -> None:
        swap_into_place(staged, self.path)

    def abandon(self, staged: PurePath | None) -> None:
        remove_staging(self.path)


class ObjectCommit(SaveProtocol):
    """The object-store protocol (see the module docstring)."""

    needs_agreement = True
    fresh_staging = True

    def __init__(self, path: PurePath, store: Storage) -> None:
        super().__init__(path, store)
        self.head: Head | None = None
        self.save: str | None = None
        self.lease: _Lease | None = None
        self.listed: list[str] | None = None
        """the names at the path when a first save (no head) began: what it removes after its commit is among
        them (a save that began later cannot commit), so it need not list again"""

    def begin(self, held: contextlib.ExitStack) -> PurePath:
        self.store.make_dir(self.path)  # on an object store: a missing bucket is a clear error now
        self.head = read_head(self.path)
        if self.head is None:
            self.listed = self._check_target()
        sequence = (self.head.sequence if self.head else 0) + 1
        self.save = f"fsdp-save-{sequence:08d}-{uuid.uuid4().hex[:12]}"
        staged = self.path / self.save
        self.store.make_dir(staged)
        self.lease = _Lease(staged / MARKER_NAME, self.save)  # the marker: a new save id, nothing of that name exists
        held.callback(self._release)  # however the save ends (committed and abandoned saves release it earlier)
        return staged

    def _check_target(self) -> list[str]:
        """Without a head, ``path`` may hold nothing, or only save directories left by killed saves (and
        claims); returns the names there. One listing (an object named like the path itself is no conflict
        on an object store, where the path is a prefix)."""
        try:
            names = self.store.list(self.path)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise FileExistsError(f"cannot save to {str(self.path)!r}: it is a file; save to another path") from None
        others = sorted(name for name in names if not _SAVE.match(name) and not _CLAIM.match(name))
        if not others:
            return names
        what = (
            "a checkpoint in the directory layout (copied there, not saved by the object-store protocol)"
            if MANIFEST_NAME in others
            else f"objects that are not a checkpoint ({', '.join(others[:5])})"
        )
        raise FileExistsError(f"cannot save to {str(self.path)!r}: it holds {what}; save to another path")

    def staged(self, name: str | None = None) -> PurePath:
        assert name is not None, "an object-store save's staging directory is named by the rank that began it"
        return self.path / name

    def publish(self, staged: PurePath) -> None:
        sequence = int(_SAVE.match(staged.name).group(1))  # type: ignore[union-attr]  # named by begin()
        fields = {"format": "fsdp_dtensor", "save": staged.name, "sequence": sequence, "committed_ns": time.time_ns()}
        record = json.dumps(fields, sort_keys=True)
        assert self.save == staged.name, "published by the protocol object that began the save"
        with contextlib.ExitStack() as claimed:
            head = self.head
            if not getattr(self.store, "conditional_put", False):
                # put_if checks, then writes: two committers could both pass the check (and a version such as
                # an inode number can come back). Committers take turns by an exclusively created claim, and
                # compare the head's save name, never reused, with the one this save read.
                claimed.enter_context(self._claim(staged))
                head = read_head(self.path)
                if (head and head.save) != (self.head and self.head.save):
                    self._lost(staged)
            version = head.version if head is not None else None
            try:
                self.store.put_if(self.path / HEAD_NAME, record.encode(), version=version)
            except VersionConflict:
                self._lost(staged)
            finally:
                self._release()  # committed (the head names it now) or removed
        committed = self.head.save if self.head is not None else None
        remove_replaced(self.path, sequence, keep=staged.name, listed=self.listed, committed=committed)
        if not getattr(self.store, "conditional_put", False):
            _remove_claims(self.path, below=sequence)

    def _lost(self, staged: PurePath) -> NoReturn:
        self.abandon(staged)
        raise self._concurrent() from None

    def _concurrent(self) -> ConcurrentSaveError:
        return ConcurrentSaveError(
            f"another save committed {str(self.path)!r} while this one was writing; the checkpoint there is "
            "that save's, this one's objects were removed (one writer per path: save elsewhere, or again)"
        )

    def lost(self, staged: PurePath) -> Exception | None:
        # A committed save removes the saves it replaced, marker last: one of the same sequence still writing too.
        return self._concurrent() if staged.name == self.save and not is_ours(staged) else None

    @contextlib.contextmanager
    def _claim(self, staged: PurePath) -> Iterator[None]:
        """Hold the claim on the head this save read (created only if absent) while it checks and writes the head."""
        claim = self.path / _claim_name(self.head)
        try:
            self.store.put_if(claim, _lease_record(staged.name), version=None)
        except VersionConflict:
            self.abandon(staged)
            raise ConcurrentSaveError(
                f"another save is committing {str(self.path)!r} right now ({_claim_holder(claim)}); this one's "
                "objects were removed (one writer per path: save elsewhere, or again). If no other save to this "
                f"path is running, a save was killed while committing: `fsdp-ckpt gc {self.path}` removes its claim"
            ) from None
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                self.store.delete(claim, missing_ok=True)

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    def abandon(self, staged: PurePath | None) -> None:
        self._release()
        # Its own save directory, by its unique name: removed even when a racing save's cleanup already took
        # the marker (and then objects this save went on writing) from it.
        if staged is not None and staged.name == self.save:
            with contextlib.suppress(OSError):
                self.store.remove_tree(staged)


def _claim_name(head: Head | None) -> str:
    return CLAIM_PREFIX + (head.save if head is not None else "first")


def _remove_claims(path: PurePath, *, below: int | None = None, force: bool = True) -> list[str]:
    """Remove the claims at ``path`` on heads of a sequence ``below`` (all: ``None``): those heads were replaced,
    so whoever holds such a claim can no longer commit; a later head's claim may be held by a live save
    (unless ``force``, kept while its lease is held). Never raises."""
    store = storage_for(path)
    removed = []
    try:
        for name in store.list(path):
            found = _CLAIM.match(name)
            if found and (below is None or found.group(1) == "first" or _sequence(found.group(1)) < below):
                if not force and _held_by(path / name) is not None:
                    continue
                store.delete(path / name, missing_ok=True)
                removed.append(name)
    except OSError as exc:
        logger.warning("could not remove stale commit claims under %s (%s); `fsdp-ckpt gc %s` does", path, exc, path)
    return removed


def _sequence(save: str) -> int:
    return int(_SAVE.match(save).group(1))  # type: ignore[union-attr]  # a save name, matched by the caller


def _claim_holder(claim: PurePath) -> str:
    """What the claim at ``claim`` says of the save holding it, for an error message."""
    try:
        with storage_for(claim).open_read(claim) as f:
            holder = json.loads(f.read(_HEAD_BYTES))
        return f"{claim} is held by save {holder['save']}, pid {holder['pid']} on host {holder['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{claim} exists"


def remove_replaced(
    path: PurePath, sequence: int, *, keep: str, listed: list[str] | None = None, committed: str | None = None
) -> None:
    """Remove the save directories of ``path`` up to ``sequence`` but ``keep`` (see the module docstring), among
    ``listed`` names where given (else listed now); ``committed``, the save the replaced head named, finished
    every upload before its commit (no unfinished upload to look for). Never raises: what is left is removed by
    a later save or ``fsdp-ckpt gc``."""
    try:
        for name in _saves(path) if listed is None else sorted(n for n in listed if _SAVE.match(n)):
            if name != keep and int(_SAVE.match(name).group(1)) <= sequence:  # type: ignore[union-attr]
                _remove_save(path / name, uploads=name != committed)
    except OSError as exc:
        logger.warning("could not remove replaced saves under %s (%s); `fsdp-ckpt gc %s` removes them", path, exc, path)


def collect_garbage(path: str | os.PathLike, *, force: bool = False) -> list[str]:
    """Remove what killed or failed saves left at ``path``: every save directory its head does not name
    (object-store protocol), or the staging directory (renames). Returns the names removed.

    Never what a save in progress writes: this process's async save in flight (and any being staged) is
    waited for; another process's save is left alone, by its lease (object-store protocol, see the module
    docstring) or its write lock (renames). ``force``: remove leftovers whose lease looks held too (a save
    on another host killed less than :data:`LEASE_S` ago; run it only while no save to ``path`` runs).
    """
    wait_for_saves("gc removes unfinished saves")
    path = locate(path)
    if not storage_for(path).renames_atomically:
        return remove_unfinished(path, force=force)
    try:
        with write_lock(path, timeout=0):  # held by a save of another process while it writes its staging
            return remove_unfinished(path)
    except TimeoutError as exc:
        logger.warning("gc: a save to %s is in progress (%s); nothing removed", path, exc)
        return []


def remove_unfinished(path: PurePath, *, force: bool = False, replaced: int | None = None) -> list[str]:
    """:func:`collect_garbage` without waiting for saves in flight nor taking the write lock: for the writer
    thread's own retention. A save directory whose lease is held is kept unless ``force``; one whose sequence
    is at most the head's (or ``replaced``, the sequence of a head just deleted) read an older head and can
    never commit: removed whatever its lease says."""
    store = storage_for(path)
    if store.stat(path) is None:
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    if store.renames_atomically:
        staged = staging_path(path)
        if is_ours(staged):
            remove_staging(path)
            return [staged.name]
        return []
    head = read_head(path)
    settled = head.sequence if head is not None else replaced
    removed = []
    for name in _saves(path):
        if head is not None and name == head.save:
            continue
        in_flight = not force and (settled is None or _sequence(name) > settled)
        holder = _held_by(path / name / MARKER_NAME) if in_flight else None
        if holder is not None:
            logger.warning("gc: %s is being written (%s); left alone", path / name, holder)
            continue
        _remove_save(path / name, marked_only=False)
        removed.append(name)
    return removed + _remove_claims(path, force=force)  # any left by a save killed while committing


class _Lease:
    """A save in progress, announced in its marker (see the module docstring): written now, renewed every
    ``LEASE_S / 3`` seconds by a daemon thread until :meth:`release`."""

    def __init__(self, marker: PurePath, save: str) -> None:
        self.marker = marker
        self.save = save
        self.store = storage_for(marker)
        with _leases_lock:
            _leases.add(str(marker))
        self.store.write_file(marker, _lease_record(save), sync_dir=True)  # found after a crash
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="checkpoint-save-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            try:
                version = self.store.version(self.marker)
                if version is None:
                    return  # a racing save's cleanup took it: this save cannot commit, and fails on its own
                self.store.put_if(self.marker, _lease_record(self.save), version=version)
            except OSError as exc:  # VersionConflict included: never brought back once removed
                logger.warning("could not renew the lease of the save writing %s (%s)", self.marker.parent, exc)
                return

    def release(self) -> None:
        """Stop renewing (the marker stays: what removes the save directory removes it last)."""
        self._stop.set()
        with _leases_lock:
            _leases.discard(str(self.marker))


_leases: set[str] = set()  # the markers of this process's saves in progress
_leases_lock = threading.Lock()


def _lease_record(save: str) -> bytes:
    holder = {"save": save, "pid": os.getpid(), "host": socket.gethostname(), "renewed_ns": time.time_ns()}
    return json.dumps({**holder, "lease_s": LEASE_S}).encode()


def _held_by(where: PurePath) -> str | None:
    """Who holds the lease recorded at ``where`` (a save's marker, a commit claim) while it is held, else
    ``None``: absent, not a lease (a marker written before leases), or stale (see the module docstring)."""
    try:
        found = _read_versioned(storage_for(where), where, _HEAD_BYTES)
        if found is None:
            return None
        record = json.loads(found[0])
        pid, host, renewed_ns, lease_s = record["pid"], record["host"], record["renewed_ns"], record["lease_s"]
        if not (type(pid) is int and isinstance(host, str) and type(renewed_ns) is int):
            return None
        lease_ns = float(lease_s) * 1e9
    except (OSError, ValueError, KeyError, TypeError):
        return None
    holder = f"save {record.get('save')!r}, pid {pid} on host {host}"
    if host == socket.gethostname() and pid == os.getpid():
        with _leases_lock:
            return holder if str(where) in _leases else None  # a save of this process: in progress or over
    if host == socket.gethostname():
        return holder if _alive(pid) else None
    return holder if time.time_ns() - renewed_ns < lease_ns else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return pid > 0


def _saves(path: PurePath) -> list[str]:
    try:
        names = storage_for(path).list(path)
    except FileNotFoundError:
        return []
    return sorted(name for name in names if _SAVE.match(name))


def _remove_save(directory: PurePath, *, marked_only: bool = True, uploads: bool = True) -> None:
    """Remove one save directory: its manifest first (a kill midway leaves it uncommitted, never half-read).

    ``marked_only``: only with the marker (what a save removes by itself); ``fsdp-ckpt gc``, run by the
    user, also removes one of the save name pattern that lost its marker (a save killed
    after a racing save's cleanup took it). ``uploads``: also abort the multipart uploads a kill left
    unfinished in it (on an object store; before the marker: with the marker gone, nothing finds this save again).
    """
    store = storage_for(directory)
    if marked_only and not is_ours(directory):
        return  # no marker: left alone
    store.delete(directory / MANIFEST_NAME, missing_ok=True)
    for name in store.list(directory):
        if name != MARKER_NAME:
            store.delete(directory / name, missing_ok=True)
    abort_uploads = getattr(store, "abort_uploads", None)  # object stores only
    if uploads and abort_uploads is not None:
        abort_uploads(directory)
    store.delete(directory / MARKER_NAME, missing_ok=True)
    with contextlib.suppress(OSError):
        store.remove_dir(directory)
