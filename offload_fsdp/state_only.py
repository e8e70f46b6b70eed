"""State-only offload (``offload_state_only=True``): the device share is updated on the device, by the
device's optimizer, while its masters and optimizer state are parked in host memory between steps.

The device share (every trainable param whose update ``offload_fraction`` leaves on the device) is cut
into buckets of at most ``bucket_numel`` elements, each with its own ``gpu_optimizer_cls`` instance
(:class:`~offload_fsdp.delegate.DelegatedOptimizer`). Between steps each bucket's device fp32 masters
and state tensors hold views of one host allocation (:class:`_HostBuffers`, page-locked on an
accelerator); a bucket's update:

1. **fetch**: one device buffer laid out as the host allocation, one H2D into it on a side stream (ordered
   after the bucket's last write-back on the device); started as soon as the bucket's first grad is final
   in backward (post-accumulate-grad hook) when the budget has room, else by ``step()``;
2. **update**: the main stream waits for that H2D, the bucket's optimizer steps, low-precision params
   take their master's cast (exactly the device share's update, so the bits are those of the same
   optimizer kept on the device);
3. **park**: one D2H into the host allocation on a side stream, queued after the update (a tensor the
   update created or replaced, as the first update's moments: one D2H each, that time); the
   tensors hold the host buffers from now on, and nothing holds the device buffers: the allocator reuses
   them once the D2H is done (``CopyQueues.free_after_d2h``), so the write-back overlaps what follows
   and the next forward runs without them, whether or not anything waits on the write-back.

The tensors keep their identity throughout (their ``.data`` moves, as FSDP1's CPU offload moves a
param's): torch's optimizer keeps its state keyed and referenced as before, and ``optimizer.state``,
checkpoints, loads and ``materialize_state`` see the host buffers between steps.

Device memory held for this share's masters + state, counting buffers whose D2H is still in flight
(until it is seen done), never exceeds ``state_device_bytes`` (one bucket's update also holds its grads
cast to the master's dtype and the class's temporaries, outside it): a prefetch that does not fit is
left to ``step()``, which first waits for write-backs in flight and drops buckets prefetched but not
needed yet. A bucket never stepped has no measured size: it is fetched with nothing else held, and a
bucket larger than the budget is a ``ValueError`` naming both. Host reads (``state_dict``, loads, ``materialize_state``,
``wait_for_params``) first wait for the write-backs (:meth:`StateOnlyUpdate.settle`).

Where copies run: :func:`parking_device_for` (the one place; ``torch.Stream`` queues on an accelerator,
plain copies on the CPU, an emulated asynchronous device in tests).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offload_fsdp.delegate import DelegatedOptimizer
from offload_fsdp.host_memory import HostArena, HostLayout
from offload_fsdp.master import MASTER_KEY
from offload_fsdp.placement import Placement
from offload_fsdp.records import ParamShard
from offload_fsdp.transfer_ring import Completion, CopyQueues, StreamQueues

__all__ = ["ParkedBucket", "ParkingDevice", "StateOnlyPlacement", "StateOnlyUpdate", "parking_device_for"]

StepDelegate = Callable[[DelegatedOptimizer, list[tuple[ParamShard, torch.Tensor]]], None]
"""(a bucket's optimizer, its (record, local grad) pairs) -> the update (``Placement.step_delegate``)"""


class _Done:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostQueues:
    """:class:`~offload_fsdp.transfer_ring.CopyQueues` of the CPU: copies done when queued."""

    def mark_main(self) -> Completion:
        return _Done()

    def main_waits(self, event: Completion) -> None:
        pass

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Completion:
        dst.copy_(src)
        return _Done()

    def h2d(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Completion) -> Completion:
        for dst, src in pairs:
            dst.copy_(src)
        return _Done()

    def free_after_d2h(self, src: torch.Tensor) -> None:
        pass


@dataclass(frozen=True)
class ParkingDevice:
    """Where a device's parked state goes and how it moves: device buffers, host buffers, copy queues."""

    device: torch.device
    queues: CopyQueues
    pin: bool
    """page-lock the host buffers (an accelerator's; the asynchronous D2H / H2D need it)"""

    def device_like(self, t: torch.Tensor) -> torch.Tensor:
        """An uninitialised device buffer shaped like ``t`` (an H2D fills it)."""
        return torch.empty(t.shape, dtype=t.dtype, device=self.device)


def parking_device_for(device: torch.device) -> ParkingDevice:
    """The parking of ``device``'s state: side streams and page-locked buffers on an accelerator, plain
    copies on the CPU. The one place this is chosen (tests substitute an emulated asynchronous device)."""
    if device.type == "cpu":
        return ParkingDevice(device, _HostQueues(), pin=False)
    return ParkingDevice(device, StreamQueues(device), pin=True)


@dataclass(eq=False)
class _HostBuffers:
    """A bucket's parked tensors in ONE host allocation (page-locked on an accelerator, exactly sized:
    :class:`~offload_fsdp.host_memory.HostArena`), one view each, in :func:`_movable` order; a device
    buffer laid out the same way makes a fetch or a write-back one copy."""

    arena: HostArena
    views: list[torch.Tensor]
    """one per tensor, shaped like it"""

    @classmethod
    def for_tensors(cls, tensors: list[torch.Tensor], *, pin: bool) -> _HostBuffers:
        layout = HostLayout()
        handles = [layout.add(t.numel(), t.dtype) for t in tensors]
        arena = layout.allocate(pin=pin)
        return cls(arena, [arena.view(h).view(t.shape) for h, t in zip(handles, tensors)])

    @property
    def nbytes(self) -> int:
        return self.arena.storage.nbytes

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Its views are shaped and typed like ``tensors``, one each."""
        return len(tensors) == len(self.views) and all(
            t.shape == v.shape and t.dtype == v.dtype for t, v in zip(tensors, self.views)
        )

    def held_by(self, tensors: list[torch.Tensor]) -> bool:
        """Each of ``tensors`` holds its view now (none replaced, added or dropped since they were parked)."""
        return self.fits(tensors) and all(t.data_ptr() == v.data_ptr() for t, v in zip(tensors, self.views))

    def device_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The views of ``flat``, a device buffer like ``arena.storage``, laid out as the host views."""
        return [self.arena.view_in(flat, i).view(v.shape) for i, v in enumerate(self.views)]


@dataclass(eq=False)
class _Moved:
    """One tensor of a bucket while it is on the device."""

    tensor: torch.Tensor
    """the optimizer's own tensor (a master or a state tensor); its ``.data`` is ``device`` now"""
    host: torch.Tensor
    """the host buffer it held before (and holds again once parked)"""
    device: torch.Tensor


@dataclass(eq=False, kw_only=True)
class ParkedBucket:
    """A run of device-share records of one group and device, whose masters and state park on the host."""

    index: int
    records: list[ParamShard]
    delegate: DelegatedOptimizer
    parking: ParkingDevice
    host: _HostBuffers | None = None
    """where its tensors are parked"""
    resident: list[_Moved] | None = None
    """the tensors on the device (fetched, or being updated); None: parked"""
    resident_flat: torch.Tensor | None = None
    """the one device buffer ``resident`` are views of (fetched in one copy); None: a buffer each"""
    fetched: Completion | None = None
    """completion of the H2D of ``resident``"""
    writing_back: list[tuple[Completion, int]] = field(default_factory=list)
    """D2H in flight: (completion, bytes of the device buffers it reads); the buffers themselves are dropped
    at once (the allocator reuses them when the D2H is done), the bytes count until it is seen done"""
    measured_bytes: int | None = None
    """device bytes of its masters + state after its last update (None: never updated)"""

    def held_bytes(self) -> int:
        """Device bytes this bucket holds now (resident, and buffers a D2H still reads)."""
        if self.resident is None:
            resident = 0
        elif self.resident_flat is not None:
            resident = _nbytes(self.resident_flat)
        else:
            resident = sum(_nbytes(m.device) for m in self.resident)
        return resident + sum(n for _, n in self.writing_back)


class StateOnlyUpdate:
    """The state-only share's buckets, their device updates and the device-memory budget (module doc).

    ``budget``: ``state_device_bytes`` (None: no bound). ``parking_for``: a device's
    :class:`ParkingDevice`. ``delegate_for``: a bucket's optimizer over some records.
    """

    def __init__(
        self,
        *,
        budget: int | None,
        bucket_numel: int,
        parking_for: Callable[[torch.device], ParkingDevice],
        delegate_for: Callable[[list[ParamShard]], DelegatedOptimizer],
    ) -> None:
        self.budget, self._bucket_numel = budget, bucket_numel
        self._parking_for, self._delegate_for = parking_for, delegate_for
        self._parkings: dict[torch.device, ParkingDevice] = {}
        self.buckets: list[ParkedBucket] = []
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ placing

    def add(self, records: list[ParamShard]) -> None:
        """Bucket the new trainable device-share ``records`` (working tensors set), park their masters
        now and hook their params so that a bucket is fetched as its grads become final."""
        for run in _runs(records, self._bucket_numel):
            device = run[0].local.device
            if device not in self._parkings:  # one per device (an accelerator's: two side streams)
                self._parkings[device] = self._parking_for(device)
            parking = self._parkings[device]
            bucket = ParkedBucket(index=len(self.buckets), records=run, delegate=self._delegate_for(run),
                                  parking=parking)  # fmt: skip
            self.buckets.append(bucket)
            for r in run:
                r.parked = bucket
            # the device fp32 masters the device share would keep (and state a class makes in __init__,
            # torch's Adagrad): parked from the start
            tensors = _movable(bucket)
            bucket.host = _HostBuffers.for_tensors(tensors, pin=parking.pin)
            for t, view in zip(tensors, bucket.host.views):
                view.copy_(t)
                t.data = view
        self._hooks.extend(_prefetch_hooks(self, records))

    @staticmethod
    def bucket_of(r: ParamShard) -> ParkedBucket:
        assert r.parked is not None, f"{r.name}: not in the state-only share"
        return r.parked

    @property
    def held_bytes(self) -> int:
        return sum(b.held_bytes() for b in self.buckets)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes of the parked masters and state (their host buffers; 0 on the CPU)."""
        return sum(b.host.nbytes for b in self.buckets if b.host is not None and b.host.arena.pinned)

    # ------------------------------------------------------------------ the step

    def step(self, active: list[tuple[ParamShard, torch.Tensor]], step_delegate: StepDelegate) -> None:
        """Update the buckets of ``active`` (record, local grad): the fetched ones first, each fetched
        (within the budget), updated on the device and parked, its D2H left in flight."""
        by_bucket: dict[int, list[tuple[ParamShard, torch.Tensor]]] = {}
        for r, g in active:
            by_bucket.setdefault(self.bucket_of(r).index, []).append((r, g))
        order = sorted(by_bucket, key=lambda i: (self.buckets[i].resident is None, -i))
        for i in order:
            bucket = self.buckets[i]
            self._fetch(bucket, wait=True, keep={j for j in order if j != i})
            assert bucket.fetched is not None
            bucket.parking.queues.main_waits(bucket.fetched)  # the update reads the state only once it landed
            step_delegate(bucket.delegate, by_bucket[i])
            self._park(bucket)

    def prefetch(self, bucket: ParkedBucket) -> None:
        """A grad of ``bucket`` is final: start its H2D now if the budget has room without waiting."""
        if bucket.resident is None and bucket.measured_bytes:
            self._fetch(bucket, wait=False, keep=set())

    def settle(self) -> None:
        """Every master and state tensor back in its host buffer, final: buckets fetched ahead of
        ``step()`` drop their device copies (unchanged), write-backs in flight are waited for."""
        for bucket in self.buckets:
            if bucket.resident is not None:
                if bucket.fetched is not None:
                    bucket.fetched.synchronize()  # its H2D still reads the host buffers
                self._release_resident(bucket)
            self._wait_written_back(bucket)

    # ------------------------------------------------------------------ moves

    def _fetch(self, bucket: ParkedBucket, *, wait: bool, keep: set[int]) -> bool:
        """Put ``bucket``'s tensors on the device (H2D queued). ``wait``: make room (write-backs waited
        for, fetched buckets not in ``keep`` dropped); else give up when it does not fit."""
        if bucket.resident is not None:
            return True
        for done, _ in bucket.writing_back:
            # its H2D (queued after the main stream's work) reads the host buffers its last D2H writes:
            # ordered on the device, the host does not wait (that D2H usually landed during the forward)
            bucket.parking.queues.main_waits(done)
        self._forget_landed(bucket)
        tensors = _movable(bucket)
        # all parked in its host buffers (else fresh or loaded tensors since: fetched one by one)
        host = bucket.host if bucket.host is not None and bucket.host.held_by(tensors) else None
        need = bucket.measured_bytes if bucket.measured_bytes is not None else self.budget
        need = max(need or 0, host.nbytes if host is not None else sum(_nbytes(t) for t in tensors))
        if not self._room(need, wait=wait, keep=keep | {bucket.index}):
            return False
        parking, after = bucket.parking, bucket.parking.queues.mark_main()
        if host is not None:
            flat = parking.device_like(host.arena.storage)
            moved = [_Moved(t, t.data, d) for t, d in zip(tensors, host.device_views(flat))]
            bucket.fetched = parking.queues.h2d([(flat, host.arena.storage)], after=after)
        else:
            flat = None
            moved = [_Moved(t, t.data, parking.device_like(t)) for t in tensors]
            bucket.fetched = parking.queues.h2d([(m.device, m.host) for m in moved], after=after)
        for m in moved:
            m.tensor.data = m.device
        bucket.resident, bucket.resident_flat = moved, flat
        return True

    def _room(self, need: int, *, wait: bool, keep: set[int]) -> bool:
        """Whether ``need`` more device bytes fit the budget, after (``wait``) freeing what may be freed."""
        if self.budget is None:
            return True
        for bucket in self.buckets:
            self._forget_landed(bucket)
        if self.held_bytes + need <= self.budget:
            return True
        if not wait:
            return False
        for bucket in self.buckets:  # write-backs in flight first: they are done or nearly
            self._wait_written_back(bucket)
        for bucket in self.buckets:
            if self.held_bytes + need <= self.budget:
                break
            if bucket.resident is not None and bucket.index not in keep:
                assert bucket.fetched is not None
                bucket.fetched.synchronize()
                self._release_resident(bucket)
        if self.held_bytes + need > self.budget:
            for bucket in self.buckets:  # even the buckets of this step's own plan
                if bucket.resident is not None and self.held_bytes + need > self.budget:
                    assert bucket.fetched is not None
                    bucket.fetched.synchronize()
                    self._release_resident(bucket)
        return True

    def _park(self, bucket: ParkedBucket) -> None:
        """Queue the D2H of ``bucket``'s tensors after its update; they hold their host buffers from now on."""
        assert bucket.resident is not None
        tensors = _movable(bucket)  # also the state the update just created on the device
        devices = [t.data for t in tensors]
        flat = bucket.resident_flat
        if flat is None or not _still_hold(bucket.resident, tensors):
            flat = None  # fetched one by one, or the update made or replaced a tensor: parked one by one
            self._lay_out_host(bucket, tensors)
        assert bucket.host is not None
        queues = bucket.parking.queues
        bucket.resident, bucket.resident_flat, bucket.fetched = None, None, None
        if flat is not None:
            done = queues.d2h(bucket.host.arena.storage, flat)
            sources, size = [flat], _nbytes(flat)
        else:
            for view, device in zip(bucket.host.views, devices):
                done = queues.d2h(view, device)
            sources, size = devices, sum(_nbytes(d) for d in devices)
        for t, view in zip(tensors, bucket.host.views):
            t.data = view  # reads are valid once the D2H is waited for (settle())
        for device in sources:
            # Nothing here holds the device buffer from now on: freed as soon as its D2H is done, so the
            # next forward runs without it, whether or not anything waits on the write-back before
            queues.free_after_d2h(device)
        if tensors:
            bucket.writing_back.append((done, size))
        bucket.measured_bytes = size
        _show_host_buffers(bucket)
        if self.budget is not None and size > self.budget:
            raise ValueError(
                f"state_device_bytes={self.budget} is smaller than the optimizer state of one state-only bucket "
                f"({size} bytes: params {[r.name for r in bucket.records][:4]}...); raise state_device_bytes to at "
                f"least {size}, or lower bucket_numel"
            )

    @staticmethod
    def _lay_out_host(bucket: ParkedBucket, tensors: list[torch.Tensor]) -> None:
        """Host buffers for ``tensors`` (the old ones if shaped alike): the update created state, or fresh or
        loaded state made on the host replaced some since the last park."""
        if bucket.host is not None and bucket.host.fits(tensors):
            return
        if bucket.fetched is not None:
            bucket.fetched.synchronize()  # the old host buffers are freed now: their H2D must have run
        bucket.host = _HostBuffers.for_tensors(tensors, pin=bucket.parking.pin)

    def _release_resident(self, bucket: ParkedBucket) -> None:
        """Drop a fetched bucket's device copies (never updated since: the host buffers are current)."""
        assert bucket.resident is not None
        for m in bucket.resident:
            m.tensor.data = m.host
        bucket.resident, bucket.resident_flat, bucket.fetched = None, None, None
        _show_host_buffers(bucket)

    @staticmethod
    def _wait_written_back(bucket: ParkedBucket) -> None:
        for done, _ in bucket.writing_back:
            done.synchronize()  # the host buffers are final (and the device memory the D2H read is free) now
        bucket.writing_back.clear()

    @staticmethod
    def _forget_landed(bucket: ParkedBucket) -> None:
        """Stop counting the write-backs already done (their device memory is free again)."""
        bucket.writing_back = [(done, n) for done, n in bucket.writing_back if not done.query()]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _still_hold(resident: list[_Moved], tensors: list[torch.Tensor]) -> bool:
    """``tensors`` are the fetched ones, in order, each still holding its device buffer."""
    return len(resident) == len(tensors) and all(
        m.tensor is t and t.data_ptr() == m.device.data_ptr() and t.shape == m.device.shape
        for m, t in zip(resident, tensors)
    )


def _runs(records: list[ParamShard], bucket_numel: int) -> list[list[ParamShard]]:
    """``records`` in order, cut into runs of one group and device of at most ``bucket_numel`` elements."""
    runs: list[list[ParamShard]] = []
    size = 0
    for r in records:
        last = runs[-1] if runs else None
        key = (r.group_index, r.local.device)
        if (
            last is None
            or (last[0].group_index, last[0].local.device) != key
            or (size and size + r.numel > bucket_numel)
        ):
            runs.append([])
            size = 0
        runs[-1].append(r)
        size += r.numel
    return runs


def _movable(bucket: ParkedBucket) -> list[torch.Tensor]:
    """The tensors of ``bucket`` that live on the device during its update and on the host between:
    device masters, state tensors shaped like the param, and scalars the class keeps on the device
    (``step`` with ``fused`` / ``capturable``; torch keeps it on the CPU otherwise)."""
    inner_optimizer = bucket.delegate.inner
    group = inner_optimizer.param_groups[0]  # a bucket is one param group's run: its optimizer has one group
    scalars_on_device = bool(group.get("fused") or group.get("capturable"))
    out: list[torch.Tensor] = []
    for r in bucket.records:
        if r.has_master:
            out.append(r.working_tensor)
        inner = inner_optimizer.state.get(r.working_tensor) or {}
        for v in inner.values():
            if isinstance(v, torch.Tensor) and (v.shape == r.local.shape or (v.dim() == 0 and scalars_on_device)):
                out.append(v)
    return out


def _show_host_buffers(bucket: ParkedBucket) -> None:
    """Public state shows the tensors' current memory: DTensor views are rebuilt (plain ones are the tensors)."""
    bucket.delegate.expose(bucket.records)
    for r in bucket.records:
        if r.is_dtensor and r.state is not None and r.has_separate_master:
            r.state[MASTER_KEY] = r.wrap(r.working_tensor)


def _prefetch_hooks(update: StateOnlyUpdate, records: list[ParamShard]) -> list[Any]:
    """Post-accumulate-grad hooks: a bucket's H2D starts as its first grad is final (budget permitting)."""
    ref = weakref.ref(update)  # a hook must not keep the optimizer alive
    handles = []
    for r in records:
        if r.parked is None:
            continue

        def hook(param: torch.Tensor, record: ParamShard = r) -> None:
            owner = ref()
            if owner is not None:
                owner.prefetch(owner.bucket_of(record))

        handles.append(r.param.register_post_accumulate_grad_hook(hook))
    return handles


class StateOnlyPlacement(Placement):
    """:class:`~offload_fsdp.placement.Placement` whose device share is a :class:`StateOnlyUpdate`: one
    device optimizer per bucket, masters and state parked on the host between steps.

    ``state_device_bytes``: the budget (:attr:`~offload_fsdp.options.OffloadOptions.state_device_bytes`).
    """

    def __init__(self, *, state_device_bytes: int | None, **placement: Any) -> None:
        super().__init__(**placement)
        self.state_only = StateOnlyUpdate(
            budget=state_device_bytes,
            bucket_numel=self._bucket_numel,
            parking_for=lambda device: parking_device_for(device),  # looked up per device: tests substitute it
            delegate_for=self.new_device_delegate,
        )

    def _join(self, records: list[ParamShard]) -> None:
        self.state_only.add(records)

    @property
    def pinned_bytes(self) -> int:
        return super().pinned_bytes + self.state_only.pinned_bytes

    @property
    def device_share_note(self) -> str:
        update = self.state_only
        return (f"; device share state-only: {len(update.buckets)} buckets, masters + state parked on the host "
                f"between steps, state_device_bytes={update.budget}")  # fmt: skip

    def step_device(self, active: list[tuple[ParamShard, torch.Tensor]]) -> None:
        self.state_only.step(active, self.step_delegate)

    def delegate_of(self, r: ParamShard) -> DelegatedOptimizer | None:
        return super().delegate_of(r) if r.offloaded else self.state_only.bucket_of(r).delegate

    def settle(self) -> None:
        self.state_only.settle()

    def refresh_masters(self, records: list[ParamShard]) -> None:
        self.settle()  # a parked master is read on the host once its write-back landed
        super().refresh_masters(records)

    def materialize(self) -> None:
        self.settle()  # fresh state is made beside the parked tensors, on the host
        super().materialize()

    def load(self, state_dict: dict[str, Any], groups: list[dict[str, Any]]) -> None:
        self.settle()  # a write-back landing after the load would overwrite it
        super().load(state_dict, groups)
