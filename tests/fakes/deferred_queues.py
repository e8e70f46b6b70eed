"""An emulated asynchronous device for copy engines on a CPU: copies run only when waited on.

:class:`DeferredQueues` implements :class:`offload_fsdp.transfer_ring.CopyQueues`
as the most hostile legal device: a queued copy does nothing until an event
covering it is synchronised (or the main stream is made to wait on it), D2H
and H2D are independent lanes, and while a copy is in flight:

* its destination reads as NaN (float dtypes): a host read before the wait
  shows up as NaN in the result, never as a lucky right answer;
* its source must not change: a host write into memory a queued copy still
  reads raises :class:`SlotOverwritten` when the copy runs; a device grad
  changed before its copy ran (accumulation, clipping) makes the copy land NaN,
  so only a later copy of the final value gives the right result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SlotOverwritten(AssertionError):
    """A host buffer was written while a queued copy still read it."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)  # compares NaNs too; contiguous: stride-0 grads


class DeferredEvent:
    def __init__(self, lane: _Lane | None, seq: int) -> None:
        self.lane, self.seq = lane, seq

    def synchronize(self) -> None:
        if self.lane is not None:
            self.lane.run_until(self.seq)

    def query(self) -> bool:
        """Done without waiting: only once something waited on it (or :meth:`DeferredQueues.catch_up` ran)."""
        return self.lane is None or self.lane.ran >= self.seq


class _Lane:
    """One side stream: copies run in order, each only once an event at or after it is waited on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: list[tuple[int, Callable[[], None]]] = []
        self.queued = 0
        self.ran = 0

    def queue(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, frozen_sources: bool) -> DeferredEvent:
        """``frozen_sources``: the sources are host buffers nobody may write until the copy ran (checked).
        Otherwise (device grads, which a later micro-batch may accumulate into, or clipping edit,
        and then copy again) a source written before the copy ran was read mid-write by a real
        device: the copy lands NaN, and only a later copy of the final value may cover it."""
        snapshots = [(dst, src, _bits(src).clone()) for dst, src in pairs]
        for dst, _ in pairs:
            if dst.is_floating_point():
                dst.data.fill_(float("nan"))  # undefined until the copy lands; `.data`: no version bump

        def run() -> None:
            for dst, src, before in snapshots:
                if torch.equal(_bits(src), before):
                    dst.data.copy_(src)
                elif frozen_sources:
                    raise SlotOverwritten(f"{self.name}: a copy's source was written before the copy ran")
                else:
                    dst.data.fill_(float("nan"))  # raced with the write: undefined

        self.queued += 1
        self.pending.append((self.queued, run))
        return DeferredEvent(self, self.queued)

    def run_until(self, seq: int) -> None:
        while self.pending and self.pending[0][0] <= seq:
            _, run = self.pending.pop(0)
            run()
            self.ran += 1


class DeferredQueues:
    """:class:`~offload_fsdp.transfer_ring.CopyQueues` whose copies complete only when waited on."""

    def __init__(self) -> None:
        self.d2h_lane = _Lane("D2H")
        self.h2d_lane = _Lane("H2D")

    def mark_main(self) -> DeferredEvent:
        return DeferredEvent(None, 0)  # the main stream's work is the host's own: already done

    def main_waits(self, event: DeferredEvent) -> None:
        event.synchronize()  # the next forward runs after the copies (the host stands in for the device)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> DeferredEvent:
        return self.d2h_lane.queue([(dst, src)], frozen_sources=False)

    def h2d(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: DeferredEvent) -> DeferredEvent:
        return self.h2d_lane.queue(pairs, frozen_sources=True)

    def free_after_d2h(self, src: torch.Tensor) -> None:
        pass  # a queued copy holds its source until it ran: the memory is freed then, as record_stream does

    def catch_up(self) -> None:
        """Run every queued copy, as a real device does on its own while the host goes on (nothing is waited on)."""
        for lane in (self.d2h_lane, self.h2d_lane):
            lane.run_until(lane.queued)

    @property
    def in_flight(self) -> int:
        return len(self.d2h_lane.pending) + len(self.h2d_lane.pending)
