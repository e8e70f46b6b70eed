"""Where a save is staged and how it replaces a previous checkpoint, crash-safely.

A save to ``P`` writes everything under the sibling ``P.tmp`` (data files,
``.metadata``, then ``manifest.json`` last) and is then swapped into place:

1. if ``P`` holds a committed checkpoint: ``rename(P, P.old)``;
2. ``rename(P.tmp, P)``; fsync the parent directory;
3. remove ``P.old``.

A ``kill -9`` at any moment leaves one of these states, each resolved without
ever mixing files of two saves:

* before 1: ``P`` is the previous checkpoint (``P.tmp`` is ignored, and
  removed or overwritten by the next save);
* between 1 and 2: ``P`` is missing and ``P.old`` is the previous checkpoint:
  :func:`resolve_for_load` falls back to ``P.old`` (with a warning), and the
  next save renames it back first;
* after 2: ``P`` is the new checkpoint; a leftover ``P.old`` is removed by the
  next save.

A fresh path never exists before step 2, so it is either complete or absent
(``FileNotFoundError`` that mentions an unfinished ``P.tmp``).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from checkpoint.durable import fsync_dir
from checkpoint.manifest import MANIFEST_NAME, NotACheckpointError

__all__ = ["OLD_SUFFIX", "TMP_SUFFIX", "is_committed", "old_path", "resolve_for_load", "staging_path", "swap_into_place"]

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"


def staging_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + TMP_SUFFIX)


def old_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + OLD_SUFFIX)


def is_committed(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def recover_interrupted_swap(path: str | os.PathLike, *, complete: Callable[[Path], bool] = is_committed) -> None:
    """Undo a swap killed between its two renames: ``P.old`` goes back to ``P``. Rank 0 / one process only.

    ``complete`` tells a finished output (default: a committed checkpoint), as in :func:`swap_into_place`.
    """
    path, old = Path(path), old_path(path)
    if not path.exists() and complete(old):
        logger.warning("recovering %s from %s left by an interrupted save", path, old)
        os.replace(old, path)
        fsync_dir(path.parent)


def swap_into_place(
    staged: str | os.PathLike, path: str | os.PathLike, *, complete: Callable[[Path], bool] = is_committed
) -> None:
    """Replace ``path`` by the committed directory ``staged`` (see the module docstring). One process only.

    ``complete(directory)`` says whether a directory holds a finished output:
    by default a committed checkpoint; other writers (``fsdp-ckpt export``)
    pass their own commit record. ``staged`` must be complete. Raises
    ``FileExistsError`` when ``path`` exists but is not complete (and not
    empty): that is user data this function will not delete.
    """
    staged, path, old = Path(staged), Path(path), old_path(path)
    assert complete(staged), f"{staged} must be committed before it is swapped in"
    recover_interrupted_swap(path, complete=complete)
    if path.exists():
        if complete(path):
            if old.exists():
                shutil.rmtree(old)  # a leftover of a finished swap; P itself is committed
            os.replace(path, old)
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        else:
            raise FileExistsError(
                f"{str(path)!r} exists and is not a committed checkpoint; refusing to replace it "
                "(move it away or save to another path)"
            )
    os.replace(staged, path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def resolve_for_load(path: str | os.PathLike) -> Path:
    """The directory to read for a checkpoint saved at ``path``.

    ``path`` itself when it exists; ``P.old`` when ``path`` is missing because a
    save was killed mid-swap. Raises ``FileNotFoundError`` (naming the path,
    and an unfinished ``P.tmp`` if there is one) otherwise; a directory
    without a manifest raises :class:`~checkpoint.manifest.NotACheckpointError`
    later, from ``read_manifest``.
    """
    path = Path(path)
    if path.exists():
        return path
    old = old_path(path)
    if is_committed(old):
        logger.warning("%s is missing; loading %s left by a save that was interrupted mid-swap", path, old)
        return old
    hint = ""
    if staging_path(path).exists():
        hint = f" ({staging_path(path)} holds an unfinished save; it is not loaded)"
    raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist{hint}")


def check_committed(path: Path) -> None:
    if not is_committed(path):
        raise NotACheckpointError(
            f"{str(path)!r} has no {MANIFEST_NAME}: it is not a committed checkpoint "
            "(a save that did not finish, or a plain DCP directory)"
        )
