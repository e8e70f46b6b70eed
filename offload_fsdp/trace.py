"""Profiler ranges and the timing probe around each bucket's pipeline phases ("d2h", "host_step", "h2d").

A *phase* is one of those three per-bucket pieces of a step; the word means nothing
else in :mod:`offload_fsdp` ("stage" is the host staging buffers a grad or param
crosses the bus through).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket

__all__ = ["PhaseTrace", "profiled"]

PhaseHook = Callable[[str, "HostBucket", bool], None]
"""``hook(phase, bucket, is_begin)``, called around each bucket's phase (``scripts/bench_offload.py --timeline-json``)"""


def _profiler_on() -> bool:
    # Private `_profiler_enabled` (no public "is a profiler on?"); if torch drops it every step raises.
    return torch.autograd._profiler_enabled()


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function(name)`` while a profiler is on, else nothing.

    Its enter/exit is an op dispatched through Python; right after a bucket's host step
    has streamed hundreds of MB through the caches it runs cold, ~0.1 ms per range.
    """
    return record_function(name) if _profiler_on() else contextlib.nullcontext()


class PhaseTrace:
    """Per-bucket profiler ranges ``HybridDeviceOptimizer.<phase>[bucket <i>]`` and the optional timing hook.

    Nested inside the aggregate ``HybridDeviceOptimizer.<phase>`` ranges, so a trace shows
    the pipeline per bucket (``scripts/plot_offload_timeline.py``).
    """

    def __init__(self) -> None:
        self.hook: PhaseHook | None = None
        """optional timing probe; set by ``scripts/bench_offload.py --timeline-json``"""

    def bucket_phase(self, phase: str, bucket: HostBucket) -> contextlib.AbstractContextManager[None]:
        # Runs once per staged grad, in backward hooks too: free when nobody is profiling or timing.
        if self.hook is None and not _profiler_on():
            return contextlib.nullcontext()
        return self._ranged(phase, bucket)

    @contextlib.contextmanager
    def _ranged(self, phase: str, bucket: HostBucket) -> Iterator[None]:
        with record_function(f"HybridDeviceOptimizer.{phase}[bucket {bucket.index}]"):
            hook = self.hook
            if hook is None:
                yield
                return
            hook(phase, bucket, True)
            yield
            hook(phase, bucket, False)
