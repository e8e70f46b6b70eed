"""The one async save in flight: its future, the writer thread, and failures raised by the next save.

A leaf under :mod:`checkpoint.async_save` (which stages and submits) and
:mod:`checkpoint.state_dict_io` (whose blocking save first waits here), so
neither imports the other inside a function. Policy (see
:mod:`checkpoint.async_save`): at most one save in flight; a failure is logged
at ERROR when it happens, re-raised by its future's ``result()`` and, if
nobody asked, by the next save or :func:`wait_for_async_save` as
:class:`AsyncSaveError`; an exit with a save in flight finishes it first.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

__all__ = ["AsyncSaveError", "lock", "submit", "wait_for_async_save"]

logger = logging.getLogger("checkpoint.async_save")  # the name users filter on for save failures

lock = threading.Lock()
"""Held while a save is staged and submitted (and by whoever touches state only an idle queue may touch)."""
_executor: ThreadPoolExecutor | None = None
_in_flight: _SaveFuture | None = None


class AsyncSaveError(RuntimeError):
    """An earlier async save failed and nobody had asked its future; raised by the next save or wait.

    The save's own error is the ``__cause__``.
    """


class _SaveFuture(Future):
    """The future of one async save; remembers whether its outcome was looked at (so it is raised once)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = path
        self.observed = False

    def result(self, timeout: float | None = None):
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        self.observed = True
        return super().exception(timeout)


def _run(future: _SaveFuture, save, *args, **kwargs) -> None:
    """The writer thread's body: the save, its outcome into ``future``, a failure logged as it happens."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        save(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - handed to the future, logged, raised by the next save
        logger.error("async checkpoint save to %s failed: %s: %s", future.path, type(exc).__name__, exc)
        future.set_exception(exc)
    else:
        future.set_result(None)


def wait_for_async_save() -> None:
    """Wait for the async save in flight, if any; raise :class:`AsyncSaveError` if it failed unobserved.

    Every save calls it first, so a failure is raised once, by the next save,
    when the caller never asked the future. Raises nothing for a failure
    already seen through the future's ``result()`` / ``exception()``.
    """
    future = _in_flight
    if future is None:
        return
    wait([future])
    error = super(_SaveFuture, future).exception()
    if error is not None and not future.observed:
        future.observed = True
        raise AsyncSaveError(
            f"the async checkpoint save to {str(future.path)!r} failed ({type(error).__name__}: {error}); "
            "that checkpoint was not committed and this call did not start another save (call it again to go on; "
            "call future.result() on an async save's future to handle its failure where it happens)"
        ) from error


def _finish_at_exit() -> None:
    """Interpreter exit with a save in flight: finish it; say loudly when the last save did not commit.

    A failure nobody asked the future about is said again here: its first
    ERROR line may be far up the log, and the process is about to exit 0.
    """
    future = _in_flight
    if future is None:
        return
    if not future.done():
        logger.warning("waiting for the async checkpoint save to %s to finish before the process exits", future.path)
        wait([future])
    error = super(_SaveFuture, future).exception()
    if error is not None and not future.observed:
        logger.error(
            "the process exits, and its last async checkpoint save, to %s, did not commit (%s: %s)",
            future.path,
            type(error).__name__,
            error,
        )


# A private hook, and deliberately so: it runs before concurrent.futures' own exit hook stops every
# thread pool from taking work (registered later, so run earlier), which the save in flight still needs.
# atexit.register would run too late ("cannot schedule new futures after interpreter shutdown").
threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]


def submit(path: str | os.PathLike, save: Callable[..., None], *args: Any, **kwargs: Any) -> _SaveFuture:
    """Run ``save(*args, **kwargs)`` on the writer thread as the save in flight; call with :data:`lock` held
    after :func:`wait_for_async_save` (so the previous save is finished)."""
    global _executor, _in_flight
    assert _in_flight is None or _in_flight.done(), "submit() while a save is still in flight"
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-async-save")
    _in_flight = _SaveFuture(path)
    _executor.submit(_run, _in_flight, save, *args, **kwargs)
    return _in_flight
