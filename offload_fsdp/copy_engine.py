"""Moving gradients device->host and params host->device, synchronously or on side streams.

Two engines share one interface so the optimizer's bookkeeping is identical
with and without an accelerator:

* :class:`SyncCopyEngine`: plain ``copy_`` calls that are complete when they
  return (host-resident params, or overlap disabled). Every wait is a no-op.
* :class:`StreamCopyEngine`: D2H on one side stream, H2D on another, ordered
  against the main (current) stream by events; the host waits on an event only
  right before it touches memory a copy is still using.

Per-bucket events live on the bucket (``d2h_done``, ``h2d_done``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket

__all__ = ["CopyEngine", "StreamCopyEngine", "SyncCopyEngine"]


class CopyEngine(Protocol):
    """How one device's grads reach the host and its params return (the optimizer's transfer concern).

    The optimizer calls only these members, so an engine's kind (synchronous, streams, or the
    ring of pinned slots in :mod:`offload_fsdp.transfer_ring`) is named nowhere else:
    :func:`offload_fsdp.transfer.copy_engine_for` picks it.
    """

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes the engine itself holds (its slots; 0 when it copies to and from the buckets)."""
        ...

    def fit(self, buckets: Iterable[HostBucket]) -> None:
        """Get ready to move these new buckets too (size slots; nothing for engines without)."""
        ...

    def release_grads(self) -> None:
        """Drop every reference to device grads held since backward (``zero_grad``)."""
        ...

    def begin_step(self) -> None: ...
    def note_params_read(self) -> None: ...
    def stage_grad(self, bucket: HostBucket, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def wait_grads(self, bucket: HostBucket) -> None: ...
    def wait_params_free(self, bucket: HostBucket) -> None: ...
    def push_params(self, bucket: HostBucket, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...
    def end_step(self, main_waits: bool = True) -> None: ...
    def wait_pushed(self, bucket: HostBucket) -> None: ...
    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...


class _NoSlots:
    """The members of :class:`CopyEngine` for an engine that copies straight to and from the buckets."""

    @property
    def pinned_bytes(self) -> int:
        return 0

    def fit(self, buckets: Iterable[HostBucket]) -> None:
        pass

    def release_grads(self) -> None:
        pass


class SyncCopyEngine(_NoSlots):
    """Copies that are finished when the call returns: nothing is ever in flight."""

    def begin_step(self) -> None:
        pass

    def note_params_read(self) -> None:
        pass

    def stage_grad(self, bucket: HostBucket, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.reshape(dst.shape))

    def wait_grads(self, bucket: HostBucket) -> None:
        pass

    def wait_params_free(self, bucket: HostBucket) -> None:
        pass

    def push_params(self, bucket: HostBucket, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            dst.copy_(src.reshape(dst.shape))

    def end_step(self, main_waits: bool = True) -> None:
        pass

    def wait_pushed(self, bucket: HostBucket) -> None:
        pass

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.reshape(dst.shape))


class StreamCopyEngine(_NoSlots):
    """D2H and H2D on their own streams of ``device``; host buffers must be page-locked to overlap."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h_stream = torch.Stream(device)
        self.h2d_stream = torch.Stream(device)
        self._step_begin: torch.Event | None = None
        self._last_h2d: torch.Event | None = None
        self._record_stream_supported = True

    def _main(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def begin_step(self) -> None:
        # Marks the point after which the main stream no longer reads this step's
        # old params (forward/backward are queued before step()).
        self._step_begin = self._main().record_event()
        self._last_h2d = None

    def note_params_read(self) -> None:
        # Overlapped step (begin_step ran during backward): the main stream has now queued every
        # read of the params of the buckets started so far, so H2D queued from here on waits for
        # this later point. The H2D already queued stays tracked for end_step.
        self._step_begin = self._main().record_event()

    def stage_grad(self, bucket: HostBucket, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The grad is produced by kernels queued on the main stream (backward,
        # reduce-scatter waits, clipping): the copy must start after them.
        self.d2h_stream.wait_stream(self._main())
        with self.d2h_stream:
            dst.copy_(src.reshape(dst.shape), non_blocking=True)
        self._keep_until_copied(bucket, src)
        bucket.d2h_done = self.d2h_stream.record_event()

    def _keep_until_copied(self, bucket: HostBucket, src: torch.Tensor) -> None:
        # zero_grad(set_to_none=True) may free the grad while the copy still reads it:
        # tell the caching allocator the side stream uses this memory. A backend without
        # record_stream: hold a reference until wait_grads has seen the copy's event.
        if self._record_stream_supported:
            try:
                src.record_stream(self.d2h_stream)
                return
            except (NotImplementedError, RuntimeError):
                self._record_stream_supported = False
        bucket.d2h_sources.append(src)

    def wait_grads(self, bucket: HostBucket) -> None:
        # The host step reads the staged grads: they must have fully landed.
        if bucket.d2h_done is not None:
            bucket.d2h_done.synchronize()
            bucket.d2h_done = None
        bucket.d2h_sources.clear()  # the copies that read them have completed

    def wait_params_free(self, bucket: HostBucket) -> None:
        # The host step overwrites the master / param staging that the previous
        # step's H2D may still be reading.
        if bucket.h2d_done is not None:
            bucket.h2d_done.synchronize()
            bucket.h2d_done = None

    def push_params(self, bucket: HostBucket, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # Overwriting a device param must wait for every kernel of this iteration
        # that reads it (forward/backward were queued before step() began).
        assert self._step_begin is not None, "push_params outside begin_step/end_step"
        self.h2d_stream.wait_event(self._step_begin)
        with self.h2d_stream:
            for dst, src in pairs:
                dst.copy_(src.reshape(dst.shape), non_blocking=True)
        bucket.h2d_done = self.h2d_stream.record_event()
        self._last_h2d = bucket.h2d_done

    def end_step(self, main_waits: bool = True) -> None:
        # The next forward reads the updated params: the main stream (not the host)
        # waits for the last H2D; H2D copies are stream-ordered, so the last covers all.
        # main_waits=False: per-module forward pre-hooks call wait_pushed instead (model=).
        if self._last_h2d is not None and main_waits:
            self._main().wait_event(self._last_h2d)
        self._step_begin = None

    def wait_pushed(self, bucket: HostBucket) -> None:
        # A forward about to read this bucket's params: the main stream (not the host)
        # waits for the bucket's latest H2D (None: none queued, or the host already saw it land).
        if bucket.h2d_done is not None:
            self._main().wait_event(bucket.h2d_done)

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Blocking by design (construction, reload, load): only the current
        # stream's pending writes to ``src`` must land first, which copy_ orders.
        dst.copy_(src.reshape(dst.shape))
