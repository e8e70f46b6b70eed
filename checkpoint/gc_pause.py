"""Cyclic garbage collection paused while a save or load builds and drops its per-key objects.

A checkpoint of tens of thousands of tensors makes hundreds of thousands of
small objects (metadata entries, keys, paths) that hold no reference cycles;
every 700 allocations the collector walks them again, ~20% of a save's or
load's CPU. Reference counting still frees them; the collector's previous
state is restored on the way out, and whatever it would have found is
collected at its next run.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Cyclic GC off inside the block, for the whole process: use it where the caller waits anyway (a blocking
    save or load), not in a background writer while training goes on. Nested or concurrent blocks may turn it
    back on early (only slower); it never stays off, and stays off if the caller had turned it off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
