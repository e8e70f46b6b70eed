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
