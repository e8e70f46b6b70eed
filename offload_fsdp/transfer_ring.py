"""Bounded pinned memory: grads and params cross the bus through a small ring of pinned slots.

By default every host buffer that crosses the bus (grad staging, param staging)
is page-locked: for a 70B model on one node that is on the order of a terabyte
of pinned RAM, which takes minutes to register and which the OS can no longer
page. With ``HybridDeviceOptimizer(..., pinned_transfer_slots=n)`` every host
buffer stays pageable and each device gets a :class:`RingCopyEngine`: ``n``
page-locked slots per direction, a D2H slot the size of the largest bucket's
grads, an H2D slot the size of the largest bucket's params. Pinned bytes:
``n * (largest bucket's grad bytes + largest bucket's param bytes)``, plus under 64 bytes of
alignment per slot.

* D2H: a bucket takes a free slot at its first staged grad and keeps it until
  the host drains it. Each grad is copied (D2H side stream) into the slot at its
  offset in the bucket; draining waits for the slot's event, copies the written
  ranges into the bucket's pageable grad staging and frees the slot. With no slot
  free, a backward hook drains the oldest held slot first (waiting for that
  earlier bucket's copy to land); inside ``step()`` (between ``begin_step`` and
  ``end_step``) the grads wait, uncopied, and ``wait_grads`` starts the next
  waiting bucket's copies in the slot it just freed, so that D2H overlaps the
  host step of the bucket just drained.
* H2D: the host writes a bucket's updated params into a free slot (with none
  free it waits for the oldest in-flight H2D), the H2D side stream copies the
  slot into the device params, and the slot is free once that copy's event has
  completed.

A slot is never written while a copy still reads or writes it (its event is
waited first), and at most ``n`` slots per direction are ever in use. The host
step reads the same pageable staging as the default mode, so results are
bit-identical; the price is one extra host memcpy of each grad and param (2 bytes
each per bf16 parameter: 8 bytes read + written, next to the 28 the host Adam step
reads + writes).

Where copies run is a :class:`CopyQueues`: :class:`StreamQueues` on a device,
or a test's emulation whose copies complete only when their event is waited on
(``tests/fakes/deferred_queues.py``), which turns a missing wait into a wrong
result on a CPU.
"""

from __future__ import annotations

import logging
import numbers
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from offload_fsdp.host_memory import HostArena, HostLayout

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket

__all__ = ["CopyQueues", "RingCopyEngine", "StreamQueues", "TransferRing", "check_transfer_slots"]

logger = logging.getLogger(__name__)


class Completion(Protocol):
    """What a queued copy returns: ``synchronize()`` blocks the host until it is done (``torch.Event``)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        """Whether it is done, without blocking."""
        ...


class CopyQueues(Protocol):
    """The device's main stream and two side streams, as the ring engine uses them."""

    def mark_main(self) -> Completion:
        """An event after everything queued on the main stream so far."""
        ...

    def main_waits(self, event: Completion) -> None:
        """Work queued on the main stream from now on runs after ``event``."""
        ...

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Completion:
        """Queue ``dst.copy_(src)`` after the main stream's queued work; the caller keeps ``src`` alive until done."""
        ...

    def h2d(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Completion) -> Completion:
        """Queue ``dst.copy_(src)`` for each pair, after ``after``."""
        ...

    def free_after_d2h(self, src: torch.Tensor) -> None:
        """The caller drops ``src``, which a queued D2H reads: its memory is reused only once the D2H
        queued so far is done (the caller need not keep it alive)."""
        ...


class StreamQueues:
    """:class:`CopyQueues` on an accelerator: D2H and H2D each on their own ``torch.Stream``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.Stream(device)
        self.h2d_stream = torch.Stream(device)

    def _main(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def mark_main(self) -> torch.Event:
        return self._main().record_event()

    def main_waits(self, event: Completion) -> None:
        assert isinstance(event, torch.Event)
        self._main().wait_event(event)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Event:
        # The grad is produced by kernels queued on the main stream (backward,
        # reduce-scatter waits, clipping): the copy must start after them.
        self.d2h_stream.wait_stream(self._main())
        with self.d2h_stream:
            dst.copy_(src, non_blocking=True)
        return self.d2h_stream.record_event()

    def h2d(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Completion) -> torch.Event:
        assert isinstance(after, torch.Event)
        # Overwriting a device param must wait for every kernel of this iteration that reads it.
        self.h2d_stream.wait_event(after)
        with self.h2d_stream:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return self.h2d_stream.record_event()

    def free_after_d2h(self, src: torch.Tensor) -> None:
        # The caching allocator knows only the stream src was allocated on: without this, memory freed
        # now could go to the main stream's next allocation while the D2H still reads it.
        src.record_stream(self.d2h_stream)


@dataclass(eq=False)
class _Slot:
    """One page-locked transfer buffer and what is in flight in it."""

    memory: torch.Tensor
    """uint8 view of the ring's arena"""
    event: Completion | None = None
    """completion of the last copy queued into / out of this slot"""
    owner: HostBucket | None = None
    """D2H: the bucket whose grads the slot holds"""
    ranges: dict[int, int] = field(default_factory=dict)
    """D2H: element offset -> element count of each grad copied in (the bucket's layout)"""
    sources: list[torch.Tensor] = field(default_factory=list)
    """D2H: device grads a queued copy reads, kept alive until the slot is drained (no ``record_stream``
    needed: the memory cannot be reused before the copy's event has been waited on)"""

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        return self.memory.view(dtype)  # slots start 64-byte aligned and hold whole elements


class TransferRing:
    """A fixed set of slots: :meth:`acquire` never hands out one that a copy may still use.

    Not thread-safe by itself; :class:`RingCopyEngine` serialises each direction.
    """

    def __init__(self, slots: Iterable[_Slot] = ()) -> None:
        self._free: deque[_Slot] = deque(slots)
        self._in_use: deque[_Slot] = deque()  # oldest first
        self.capacity = len(self._free)
        self.peak_in_use = 0
        """the most slots ever in use at once (never above ``capacity``)"""

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def acquire(self, reclaim: Callable[[_Slot], None]) -> _Slot:
        """A free slot; with none free, ``reclaim`` (which must :meth:`release` it) is run on the oldest first."""
        assert self.capacity, "transfer ring used before its slots were allocated"
        if not self._free:
            reclaim(self._in_use[0])
            assert self._free, "reclaim did not release the oldest slot"
        slot = self._free.popleft()
        self._in_use.append(slot)
        self.peak_in_use = max(self.peak_in_use, len(self._in_use))
        return slot

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    def release(self, slot: _Slot) -> None:
        self._in_use.remove(slot)
        slot.event, slot.owner = None, None
        slot.ranges.clear()
        slot.sources.clear()
        self._free.append(slot)

    def oldest(self) -> _Slot | None:
        return self._in_use[0] if self._in_use else None


def _offset_in(view: torch.Tensor, flat: torch.Tensor) -> int:
    """Element offset of ``view`` (a contiguous slice of ``flat``) in ``flat``."""
    offset, rest = divmod(view.data_ptr() - flat.data_ptr(), flat.element_size())
    assert rest == 0 and 0 <= offset and offset + view.numel() <= flat.numel(), "not a view of the bucket buffer"
    return offset


def _slot_size(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 8-byte words: a slot sized for a bf16 bucket may be viewed as
    fp32 (or any dtype up to 8 bytes) by another bucket."""
    return -(-nbytes // 8) * 8


def _coalesced(ranges: dict[int, int]) -> list[tuple[int, int]]:
    """[start, end) runs covering ``ranges`` (offset -> count), adjacent runs merged: fewer host copies."""
    runs: list[tuple[int, int]] = []
    for start in sorted(ranges):
        end = start + ranges[start]
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


class RingCopyEngine:
    """The copy engine of ``pinned_transfer_slots``: every host buffer pageable, copies through pinned slots.

    Same interface as :class:`offload_fsdp.copy_engine.StreamCopyEngine`. Each
    direction has its own lock, so backward hooks (D2H) and a host worker (H2D,
    draining) may call it from different threads.
    """

    def __init__(self, device: torch.device, slots: int, *, queues: CopyQueues | None = None, pin: bool = True) -> None:
        self.device = device
        self.slots = slots
        self.queues: CopyQueues = queues if queues is not None else StreamQueues(device)
        self._pin = pin
        self.arena: HostArena | None = None
        self.slot_bytes = (0, 0)
        """(D2H, H2D) bytes of each slot"""
        self.d2h_ring = TransferRing()
        self.h2d_ring = TransferRing()
        self._held: dict[int, _Slot] = {}  # id(bucket) -> its D2H slot
        self._waiting: dict[int, tuple[HostBucket, dict[int, torch.Tensor]]] = {}
        """inside step(): buckets whose grads wait for a free D2H slot, in staging order
        (id(bucket) -> (bucket, element offset -> flat device grad))"""
        self._d2h_lock = threading.Lock()
        self._h2d_lock = threading.Lock()
        self._step_begin: Completion | None = None
        self._last_h2d: Completion | None = None

    # ------------------------------------------------------------------ memory

    @property
    def reserved_bytes(self) -> int:
        return self.arena.reserved_bytes if self.arena is not None else 0

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes of the slots (0 where nothing could be pinned)."""
        return self.reserved_bytes if self.arena is not None and self.arena.pinned else 0

    def fit(self, buckets: Iterable[HostBucket]) -> None:
        """Size the slots for ``buckets`` too: (re)allocate them when one is larger than a slot.

        Called at construction and by ``add_param_group`` (between steps); slot sizes
        only grow. Anything still in flight in the old slots is completed first.
        """
        buckets = list(buckets)
        need = (
            max([_slot_size(b.numel * b.grad_dtype.itemsize) for b in buckets] + [self.slot_bytes[0]]),
            max([_slot_size(b.numel * b.param_dtype.itemsize) for b in buckets] + [self.slot_bytes[1]]),
        )
        if need == self.slot_bytes and self.arena is not None:
            return
        self.flush()
        layout = HostLayout()
        handles = [[layout.add(nbytes, torch.uint8) for _ in range(self.slots)] for nbytes in need]
        arena = layout.allocate(pin=self._pin)
        self.d2h_ring, self.h2d_ring = (TransferRing(_Slot(arena.view(h)) for h in hs) for hs in handles)
        self.arena, self.slot_bytes = arena, need
        logger.debug("transfer ring on %s: %d slots of %s bytes (D2H, H2D)", self.device, self.slots, need)

    def flush(self) -> None:
        """Complete every copy in flight: drain held grads into their staging, wait for every H2D."""
        with self._d2h_lock:
            while self._waiting:  # each takes a slot, draining the oldest held when none is free
                self._start_waiting(next(iter(self._waiting)))
            while (slot := self.d2h_ring.oldest()) is not None:
                self._drain(slot)
        with self._h2d_lock:
            while (slot := self.h2d_ring.oldest()) is not None:
                self._reclaim(slot)

    # ------------------------------------------------------------------ CopyEngine

    def begin_step(self) -> None:
        # Marks the point after which the main stream no longer reads this step's old params.
        self._step_begin = self.queues.mark_main()
        self._last_h2d = None

    def stage_grad(self, bucket: HostBucket, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert bucket.grad_stage is not None
        if dst.numel() == 0:
            return  # nothing to move (and an empty view's data_ptr says nothing about its place)
        offset = _offset_in(dst, bucket.grad_stage)
        flat = src.reshape(-1)  # a view of the grad, or (non-contiguous grad) a copy the D2H reads
        with self._d2h_lock:
            slot = self._held.get(id(bucket))
            in_step = self._step_begin is not None
            if slot is None and in_step and (self._waiting or not self.d2h_ring.has_free):
                # Inside step() the host drains buckets in order: queue this copy when a slot
                # frees (wait_grads) rather than block here, so it overlaps a host step.
                self._waiting.setdefault(id(bucket), (bucket, {}))[1][offset] = flat
                return
            if slot is None:  # a backward hook with no slot free: wait for the oldest bucket's copy
                slot = self._take_slot(bucket)
            self._copy_in(slot, bucket, offset, flat)

    def _take_slot(self, bucket: HostBucket) -> _Slot:
        """A D2H slot for ``bucket``, which holds it until drained (the oldest held is drained if none is free)."""
        slot = self.d2h_ring.acquire(self._drain)
        slot.owner = bucket
        self._held[id(bucket)] = slot
        return slot

    def _copy_in(self, slot: _Slot, bucket: HostBucket, offset: int, flat: torch.Tensor) -> None:
        part = slot.typed(bucket.grad_dtype)[offset : offset + flat.numel()]
        slot.event = self.queues.d2h(part, flat)  # later copies into the slot are stream-ordered after it
        slot.ranges[offset] = flat.numel()
        slot.sources.append(flat)

    def _start_waiting(self, key: int) -> None:
        """Queue the D2H copies of a bucket that waited for a slot (taking one)."""
        bucket, grads = self._waiting.pop(key)
        slot = self._take_slot(bucket)
        for offset, flat in grads.items():
            self._copy_in(slot, bucket, offset, flat)

    def _drain(self, slot: _Slot) -> None:
        """Wait for the slot's D2H copies, move the grads into the owner's pageable staging, free the slot."""
        owner = slot.owner
        assert owner is not None and owner.grad_stage is not None
        if slot.event is not None:  # None: its first copy raised when queued, nothing is in flight
            slot.event.synchronize()  # the grads copied into the slot have landed
        typed = slot.typed(owner.grad_dtype)
        for start, end in _coalesced(slot.ranges):
            owner.grad_stage[start:end].copy_(typed[start:end])
        del self._held[id(owner)]
        self.d2h_ring.release(slot)

    def wait_grads(self, bucket: HostBucket) -> None:
        # The host step reads the bucket's pageable grad staging: its slot must be drained into it.
        with self._d2h_lock:
            if id(bucket) in self._waiting:  # its grads never got a slot: copy them now
                self._start_waiting(id(bucket))
            slot = self._held.get(id(bucket))
            if slot is not None:
                self._drain(slot)
            # The freed slot starts the next waiting bucket's D2H, which overlaps this bucket's host step.
            while self._waiting and self.d2h_ring.has_free:
                self._start_waiting(next(iter(self._waiting)))

    def wait_params_free(self, bucket: HostBucket) -> None:
        # No copy ever reads or writes the pageable masters / staging: the H2D reads its slot.
        pass

    def push_params(self, bucket: HostBucket, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        assert self._step_begin is not None, "push_params outside begin_step/end_step"
        if not pairs:
            return
        dtype = pairs[0][1].dtype
        assert sum(src.numel() for _, src in pairs) * dtype.itemsize <= self.slot_bytes[1], "slot too small"
        with self._h2d_lock:
            slot = self.h2d_ring.acquire(self._reclaim)
            typed, offset, copies = slot.typed(dtype), 0, []
            for dst, src in pairs:
                part = typed[offset : offset + src.numel()]
                part.copy_(src.reshape(-1))  # a free slot: no copy reads it any more
                copies.append((dst, part.view(dst.shape)))
                offset += src.numel()
            slot.event = self.queues.h2d(copies, after=self._step_begin)
        bucket.h2d_done = slot.event  # type: ignore[assignment]  # a torch.Event on a device
        self._last_h2d = slot.event

    def _reclaim(self, slot: _Slot) -> None:
        if slot.event is not None:  # None: its copy raised when queued, nothing reads the slot
            slot.event.synchronize()  # the H2D that reads this slot has finished: the host may overwrite it
        self.h2d_ring.release(slot)

    def note_params_read(self) -> None:
        """A step begun during backward: H2D queued from now on waits for the main stream's work so far.

        (The overlapped step calls it each time backward has queued every read of a
        bucket's params; the H2D already queued stays tracked for :meth:`end_step`.)
        """
        with self._h2d_lock:
            self._step_begin = self.queues.mark_main()

    def end_step(self, main_waits: bool = True) -> None:
        """``main_waits=False``: each module's forward waits for its own buckets (:meth:`wait_pushed`) instead."""
        # The next forward reads the updated params: the main stream (not the host)
        # waits for the last H2D; H2D copies are stream-ordered, so the last covers all.
        with self._h2d_lock:
            last, self._last_h2d, self._step_begin = self._last_h2d, None, None
        if last is not None and main_waits:
            self.queues.main_waits(last)
        # Grads staged for buckets that took no step (their grads were dropped before
        # step()) would otherwise hold slots, or device grads, across steps.
        with self._d2h_lock:
            self._waiting.clear()
        self.release_grads()

    def release_grads(self) -> None:
        """Free every held D2H slot and the device grads it references (``end_step``, ``zero_grad``).

        Each is drained (its copies waited for) into its bucket's staging, so a bucket
        whose host step is still to come reads the same grads; the slots are free again
        and the user's dropped grads can be freed.
        """
        with self._d2h_lock:
            for slot in list(self._held.values()):
                self._drain(slot)

    def wait_pushed(self, bucket: HostBucket) -> None:
        # A forward about to read this bucket's params: the main stream (not the host)
        # waits for the bucket's latest H2D.
        if bucket.h2d_done is not None:
            self.queues.main_waits(bucket.h2d_done)

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Blocking by design (construction, reload, load), from pageable memory: copy_ orders it
        # after the current stream's pending writes to ``src``.
        dst.copy_(src.reshape(dst.shape))


def check_transfer_slots(value: object) -> int | None:
    """``pinned_transfer_slots`` validated: None, or an int >= 1 (``ValueError`` naming the value otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"pinned_transfer_slots must be None (pin every host buffer that crosses the bus) or an int >= 1 "
            f"(that many pinned transfer slots per direction; 2-4 is typical), got {value!r}"
        )
    return int(value)
