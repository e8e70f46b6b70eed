"""The one async save in flight: its future, the writer thread, and failures raised by the next save.

A leaf under :mod:`checkpoint.async_save` (which stages and submits) and
:mod:`checkpoint.state_dict_io` (whose blocking save first waits here), so
neither imports the other inside a function. Policy (see
:mod:`checkpoint.async_save`): at most one save in flight; a failure is logged
at ERROR when it happens, re-raised by its future's ``result()`` and, if
nobody asked, by the next save or :func:`wait_for_async_save` as
:class:`AsyncSaveError`. The save in flight is not lost to the ways a training
script ends:

* the interpreter exits (the main thread returns, from any thread's save, one
  still being staged included): the save is finished first; if it did not
  commit, the process says so and exits with status 1;
* ``dist.destroy_process_group()`` (the writer's collectives need the groups):
  it waits for the save first;
* SIGTERM (when the program left its default action): the save is finished,
  then the process terminates by SIGTERM as it would have.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch.distributed as dist

__all__ = ["AsyncSaveError", "lock", "starting", "submit", "wait_for_async_save", "wait_for_saves"]

logger = logging.getLogger("checkpoint.async_save")  # the name users filter on for save failures

lock = threading.Lock()
"""Held while a save is staged and submitted (and by whoever touches state only an idle queue may touch)."""
_executor: ThreadPoolExecutor | None = None
_in_flight: _SaveFuture | None = None
_staging = threading.Condition()  # guards the two below
_starting = 0  # async saves being staged (by any thread), not yet submitted
_exiting = False  # the interpreter's exit hook has run: no save can start any more


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
        self.in_group = dist.is_available() and dist.is_initialized()
        """whether a process group was there when the save was submitted (one gone since is a likely cause)"""

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
        logger.error("async checkpoint save to %s failed: %s", future.path, _failure(exc, future.in_group))
        future.set_exception(exc)
    else:
        future.set_result(None)


def _failure(error: BaseException, in_group: bool) -> str:
    """``error`` in one line, with the fix when it is the usual cause: the process group (there when the save
    was submitted: ``in_group``) destroyed under the save."""
    text = f"{type(error).__name__}: {error}"
    if in_group and not (dist.is_available() and dist.is_initialized()):
        text += (
            " (the process group was destroyed while the save was in flight: call checkpoint.wait_for_async_save() "
            "before dist.destroy_process_group())"
        )
    return text


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Held by a thread staging an async save until it is submitted: the interpreter's exit waits for it.

    Raises ``RuntimeError`` once the exit hook has run (the main thread has
    returned): the save could not be finished any more.
    """
    global _starting
    with _staging:
        if _exiting:
            raise RuntimeError(
                "an async checkpoint save was started after the main thread returned (the interpreter is exiting); "
                "nothing would finish it: join the thread that saves before the main thread returns"
            )
        _starting += 1
    try:
        yield
    finally:
        with _staging:
            _starting -= 1
            _staging.notify_all()


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


def wait_for_saves(why: str) -> None:
    """Wait for async saves being staged (any thread) and for the one in flight, saying so at WARNING (``why``:
    what waits, e.g. "gc removes unfinished saves"); their failures are left to their futures and the next save.

    Whatever deletes checkpoint objects calls it first: a save in flight writes objects that are not
    committed yet, which would otherwise look like a killed save's leftovers. Never call it from the
    writer thread (it would wait for itself).
    """
    _wait_for_saves(why)


def _wait_for_saves(why: str) -> _SaveFuture | None:
    """Wait for saves being staged (any thread) and then for the save in flight; returns it, done, if any."""
    with _staging:
        _staging.wait_for(lambda: _starting == 0)
    future = _in_flight
    if future is not None and not future.done():
        logger.warning("waiting for the async checkpoint save to %s to finish before %s", future.path, why)
        wait([future])
    return future


def _lost(future: _SaveFuture | None) -> bool:
    """Whether ``future``'s save failed and nobody asked it: say so, loudly, once."""
    error = super(_SaveFuture, future).exception() if future is not None else None
    if future is None or error is None or future.observed:
        return False
    future.observed = True
    logger.error(
        "the process exits, and its last async checkpoint save, to %s, did not commit (%s)",
        future.path,
        _failure(error, future.in_group),
    )
    return True


def _finish_at_exit() -> None:
    """Interpreter exit: finish the saves started (from any thread); exit 1 if the last one did not commit.

    A failure nobody asked the future about is said again here: its first
    ERROR line may be far up the log. The exit status is the one sign a
    launcher (torchrun, a scheduler) sees, and the interpreter would exit 0:
    so the process ends here, with status 1, after flushing its output (the
    exit handlers registered after this point do not run).
    """
    global _exiting
    future = _wait_for_saves("the process exits")
    with _staging:
        _exiting = True
    if _lost(future):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# A private hook, and deliberately so: it runs before concurrent.futures' own exit hook stops every thread pool from
# taking work (registered later, so run earlier), which the save in flight still needs; and before the interpreter
# joins the other threads, so a save a worker thread is staging is waited for too. atexit.register would run too
# late ("cannot schedule new futures after interpreter shutdown").
threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]


def _destroy_after_saves(destroy: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        _wait_for_saves("the process group is destroyed")
        destroy(*args, **kwargs)

    destroy_process_group.waits_for_async_save = True  # type: ignore[attr-defined]
    return destroy_process_group


def _wait_in_destroy_process_group() -> None:
    """``dist.destroy_process_group()`` waits for the async save in flight: its writer's collectives need the groups.

    Training scripts commonly end by destroying the group right after their
    last save; torch has no hook for it, so the function is wrapped where
    scripts reach it (``dist.`` and ``distributed_c10d.``, as they are when
    ``checkpoint`` is imported). A script holding its own earlier reference
    bypasses the wrapper: that save then fails, which the exit hook reports
    with exit status 1, naming the fix.
    """
    if not dist.is_available() or getattr(dist.destroy_process_group, "waits_for_async_save", False):
        return
    wrapped = _destroy_after_saves(dist.destroy_process_group)
    dist.destroy_process_group = wrapped
    dist.distributed_c10d.destroy_process_group = wrapped


_wait_in_destroy_process_group()


def _finish_then_terminate(signum: int, frame: Any) -> None:
    """SIGTERM: finish the save in flight (a save being staged by this thread is abandoned), then terminate by it."""
    with _staging:
        if _starting:
            logger.error("SIGTERM while an async checkpoint save was being staged: that save is abandoned")
    future = _in_flight
    if future is not None and not future.done():
        logger.warning("SIGTERM: finishing the async checkpoint save to %s before terminating", future.path)
        wait([future])
        if super(_SaveFuture, future).exception() is None:
            logger.warning("the async checkpoint save to %s committed; terminating", future.path)
    _lost(future)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # the default action now: the exit status says SIGTERM, as it would have


def _finish_on_sigterm() -> None:
    """Install :func:`_finish_then_terminate` where the program left SIGTERM's default action (which loses the save).

    Only the main thread can install a handler; a program's own handler is left alone.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _finish_then_terminate)


def submit(path: str | os.PathLike, save: Callable[..., None], *args: Any, **kwargs: Any) -> _SaveFuture:
    """Run ``save(*args, **kwargs)`` on the writer thread as the save in flight; call with :data:`lock` held
    after :func:`wait_for_async_save` (so the previous save is finished)."""
    global _executor, _in_flight
    assert _in_flight is None or _in_flight.done(), "submit() while a save is still in flight"
    _finish_on_sigterm()
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-async-save")
    _in_flight = _SaveFuture(path)
    _executor.submit(_run, _in_flight, save, *args, **kwargs)
    return _in_flight
