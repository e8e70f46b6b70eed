"""Run a call that a hostile or damaged file might make block (a FIFO, a device), with a time limit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_bounded(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any, BaseException | None]:
    """``(hung, returned, raised)`` of ``fn()`` run on a daemon thread for at most ``timeout_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - classified by the caller
            box["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return thread.is_alive(), box.get("value"), box.get("exc")


class WorkBudgetExceeded(BaseException):
    """Raised into a call :func:`run_counted` watches once it passes its budget (a ``BaseException``, so the
    code under test cannot catch it as an error of its own)."""


def run_counted(fn: Callable[[], Any], *, max_lines: int, max_bytes: int) -> tuple[Any, BaseException | None, int, int]:
    """``(returned, raised, lines, peak bytes)`` of ``fn()``: the cost of a call as counts, not times.

    Counts the Python line events ``fn`` runs on this thread (loops count one per
    iteration) and traces its allocations (``tracemalloc``); stops it by raising
    :class:`WorkBudgetExceeded` once past ``max_lines`` or ``max_bytes`` allocated
    at once, so a regression fails in seconds instead of running for minutes.
    """
    import sys
    import tracemalloc

    lines = 0

    def on_line(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
            if lines > max_lines:
                sys.settrace(None)
                raise WorkBudgetExceeded(f"more than {max_lines} Python lines")
            if lines % 256 == 0 and tracemalloc.get_traced_memory()[0] > max_bytes:
                sys.settrace(None)
                raise WorkBudgetExceeded(f"more than {max_bytes} bytes allocated")
        return on_line

    tracemalloc.start()
    sys.settrace(lambda frame, event, arg: on_line)
    try:
        returned, raised = fn(), None
    except BaseException as exc:  # noqa: BLE001 - classified by the caller
        returned, raised = None, exc
    finally:
        sys.settrace(None)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return returned, raised, lines, peak
