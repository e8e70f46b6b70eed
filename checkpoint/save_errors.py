"""How a save fails: on every rank at once, as one ``Exception`` with one message.

Also the one place that takes DCP's ``CheckpointException`` apart
(:func:`dcp_failures`), for saves and loads alike.

DCP raises ``CheckpointException``, a ``BaseException`` that ``except
Exception`` does not catch, and only from inside its own collectives: an
error a rank hits before or outside them (converting its state dict,
checking the target) would leave the other ranks waiting forever inside
``dcp.save``. :func:`raise_on_every_rank` is the one collective a save
spends to agree on such a step, and :func:`unwrap_dcp_error` turns DCP's
exception into this rank's own error or a :class:`CheckpointSaveError`.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "CheckpointLoadError",
    "CheckpointSaveError",
    "agree_on_failure",
    "dcp_failures",
    "describe_error",
    "first_failure",
    "raise_on_every_rank",
    "raise_unwrapped",
    "unwrap_dcp_error",
]


def _rank_failures_message(doing: str, path: str | os.PathLike, failures: dict[int, str]) -> str:
    ranks = ", ".join(str(r) for r in sorted(failures))
    first = failures[min(failures)]
    more = "" if len(set(failures.values())) == 1 else f" (and {len(failures) - 1} other rank(s) failed too)"
    plural = "s" if len(failures) > 1 else ""
    return f"{doing} checkpoint {str(path)!r} failed on rank{plural} {ranks}: {first}{more}"


class CheckpointSaveError(RuntimeError):
    """A save failed on one or more ranks; nothing at the target path changed.

    ``failures`` maps each failing rank to its error message. The error of
    this rank (or DCP's exception) is the ``__cause__``.
    """

    def __init__(self, path: str | os.PathLike, failures: dict[int, str]) -> None:
        super().__init__(_rank_failures_message("saving", path, failures))
        self.failures = failures


class CheckpointLoadError(RuntimeError):
    """A collective load failed on other ranks (this rank read its part fine, which may now be in place).

    ``failures`` maps each failing rank to its error message; those ranks
    raised their own error (naming the damaged file and the fix).
    """

    def __init__(self, path: str | os.PathLike, failures: dict[int, str]) -> None:
        super().__init__(_rank_failures_message("loading", path, failures))
        self.failures = failures


def dcp_failures(exc: BaseException) -> dict[int, BaseException]:
    """``{rank: the exception that rank raised}`` inside DCP, from its ``CheckpointException``; ``{}`` for any other exception."""
    failures = getattr(exc, "failures", None) if isinstance(exc, CheckpointException) else None
    if not isinstance(failures, dict):
        return {}
    # torch 2.x stores (exception, traceback) per rank
    return {rank: f[0] if isinstance(f, tuple) and f else f for rank, f in failures.items()}


def first_failure(exc: BaseException) -> BaseException:
    """The exception the first failing rank raised inside DCP (a rank-local ``no_dist`` load: this rank's); else ``exc``."""
    return next(iter(dcp_failures(exc).values()), exc)


def describe_error(exc: BaseException) -> str:
    """One rank's error as the others report it: ``"<type>: <message>"``."""
    return f"{type(exc).__name__}: {exc}"


def agree_on_failure(
    error: BaseException | None, *, group: dist.ProcessGroup | None, distributed: bool
) -> dict[int, str]:
    """One collective: every rank learns whether any rank failed a step; raises ``error`` where it happened.

    Returns ``{rank: message}`` of the failed ranks (empty when none did) on
    every rank that did not fail itself. Single process: raises ``error`` or returns ``{}``.
    Precondition: every rank of ``group`` calls it, at the same point.
    """
    if not distributed:
        if error is not None:
            raise error
        return {}
    everyone: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, None if error is None else describe_error(error), group=group)
    if error is not None:
        raise error
    return {rank: message for rank, message in enumerate(everyone) if message is not None}


def raise_on_every_rank(
    error: BaseException | None, path: str | os.PathLike, *, group: dist.ProcessGroup | None, distributed: bool
) -> None:
    """:func:`agree_on_failure` for a save: the failing rank raises its own ``error`` (it already names
    the key and the fix); the others raise :class:`CheckpointSaveError` naming the failing rank(s).
    """
    failures = agree_on_failure(error, group=group, distributed=distributed)
    if failures:
        raise CheckpointSaveError(path, failures)


def unwrap_dcp_error(exc: CheckpointException, path: str | os.PathLike, rank: int) -> BaseException:
    """What to raise for DCP's ``CheckpointException`` (raised on every rank) on rank ``rank``; raise it ``from exc``.

    As :func:`raise_on_every_rank`: the failing rank gets its own error back
    (already clear: it names the key or file), the others a :class:`CheckpointSaveError`.
    """
    failures = dcp_failures(exc)
    if rank in failures:
        return failures[rank]
    return CheckpointSaveError(path, {r: describe_error(f) for r, f in failures.items()} or {0: str(exc)})


def raise_unwrapped(exc: CheckpointException, path: str | os.PathLike, rank: int = 0) -> None:
    """Raise :func:`unwrap_dcp_error`'s choice from inside the ``except`` that caught ``exc``."""
    error = unwrap_dcp_error(exc, path, rank)
    if isinstance(error, CheckpointSaveError):
        raise error from exc
    error.__suppress_context__ = True  # this rank's own error: DCP's wrapper of it adds nothing
    raise error
