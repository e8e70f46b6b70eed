"""The transfer concern of the optimizer: which :class:`~offload_fsdp.copy_engine.CopyEngine` moves one
device's bytes (the one place engines are chosen), and :class:`Transfer`, the grads' and params' copies
through those engines.

* a CPU-resident param, or ``overlap_cpu_optimizer_d2h_h2d=False``: :class:`~offload_fsdp.copy_engine.SyncCopyEngine`
  (blocking copies, shared by all such buckets);
* an accelerator with ``pinned_transfer_slots=n``: :class:`~offload_fsdp.transfer_ring.RingCopyEngine`
  (n page-locked slots per direction, pageable buckets);
* an accelerator otherwise: :class:`~offload_fsdp.copy_engine.StreamCopyEngine` (side streams, pinned buckets).

Everything else talks to engines through the ``CopyEngine`` protocol only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from offload_fsdp.copy_engine import CopyEngine, StreamCopyEngine, SyncCopyEngine
from offload_fsdp.records import grad_key
from offload_fsdp.trace import PhaseTrace, profiled
from offload_fsdp.transfer_ring import RingCopyEngine

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket
    from offload_fsdp.records import ParamShard

__all__ = ["Transfer", "copy_engine_for", "engine_device"]


def engine_device(device: torch.device, *, overlap: bool) -> torch.device:
    """The device whose engine serves a param on ``device``: the CPU's synchronous one unless it overlaps."""
    return device if (device.type != "cpu" and overlap) else torch.device("cpu")


def copy_engine_for(device: torch.device, *, transfer_slots: int | None) -> CopyEngine:
    """A new engine for ``device`` (as :func:`engine_device` names it); see the module docstring."""
    if device.type == "cpu":
        return SyncCopyEngine()
    if transfer_slots is not None:
        return RingCopyEngine(device, transfer_slots)
    return StreamCopyEngine(device)


class Transfer:
    """One optimizer's copy engines (one per device, made on first use) and the copies it queues on them.

    ``overlap``: ``overlap_cpu_optimizer_d2h_h2d`` (side streams; else blocking copies).
    ``transfer_slots``: ``pinned_transfer_slots``. ``main_waits``: at the end of a step the main
    stream waits for every H2D (False with ``model=``: each owning module's forward waits instead).
    """

    def __init__(self, *, overlap: bool, transfer_slots: int | None, main_waits: bool, trace: PhaseTrace) -> None:
        self.overlap, self.transfer_slots, self.main_waits = overlap, transfer_slots, main_waits
        self.trace = trace
        self.engines: dict[torch.device, CopyEngine] = {}

    def engine_for(self, device: torch.device) -> CopyEngine:
        key = engine_device(device, overlap=self.overlap)
        if key not in self.engines:
            self.engines[key] = copy_engine_for(key, transfer_slots=self.transfer_slots)
        return self.engines[key]

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes the engines hold themselves (``pinned_transfer_slots``' slots)."""
        return sum(e.pinned_bytes for e in self.engines.values())

    @staticmethod
    def fit(buckets: list[HostBucket]) -> None:
        """Let each engine size what it holds (``pinned_transfer_slots``' slots) for these new buckets too."""
        for engine in {id(b.engine): b.engine for b in buckets}.values():
            engine.fit(b for b in buckets if b.engine is engine)

    def stage_grad(self, record: ParamShard, grad: torch.Tensor) -> None:
        """Copy ``grad`` to the record's host grad staging unless this very grad, unmodified, is already there.

        The key includes the tensor's version counter: accumulation into the grad
        (next micro-batch) bumps it, so the grad is copied again. Keys are cleared after
        each step and by zero_grad, so a reused allocation can never match a stale key.
        """
        key = grad_key(grad)
        if record.staged_grad_key == key:
            return
        bucket = record.host_bucket
        with self.trace.bucket_phase("d2h", bucket):
            bucket.engine.stage_grad(bucket, record.host_grad_stage, grad)
        record.staged_grad_key = key

    def stage_grads(self, active: list[tuple[ParamShard, torch.Tensor]], done: set[int]) -> None:
        """``step()``'s copies: every (offloaded record, local grad) not staged yet, or changed since.

        A copy the hooks made under the same key is kept only when its bits are the grad's (a key
        cannot show a write below autograd, ``records.grad_key``): compared in place for a host
        grad; a device grad is copied again, which costs what reading it back to compare would.
        """
        with profiled("HybridDeviceOptimizer.d2h"):
            for r, g in active:
                hooks_copy = id(r) not in done and r.staged_grad_key == grad_key(g)
                # A host grad's engine copies synchronously (engine_device): its hooks' copy is complete.
                if hooks_copy and not (g.device.type == "cpu" and r.staging_holds(g)):
                    r.staged_grad_key = None  # the hooks' copy may predate such a write: copy again
                self.stage_grad(r, g)

    def push(self, bucket: HostBucket, records: list[ParamShard]) -> None:
        """Queue the H2D of ``records``' updated params (their cast, or the master itself)."""
        with profiled("HybridDeviceOptimizer.h2d"), self.trace.bucket_phase("h2d", bucket):
            bucket.engine.push_params(bucket, [(r.local, r.push_source) for r in records])
        for r in records:
            r.mark_synced()  # after the push: its copy_ bumped the version counter

    def begin_step(self, begun: dict[int, CopyEngine]) -> list[CopyEngine]:
        """Begin a step on every engine; those in ``begun`` (begun during backward) keep theirs. Returns all."""
        engines = list({id(e): e for e in [*self.engines.values(), *begun.values()]}.values())
        for engine in engines:
            if id(engine) in begun:
                engine.note_params_read()  # begun during backward: keep its H2D, move the read mark to now
            else:
                engine.begin_step()
        return engines

    def end_step(self, engines: Iterable[CopyEngine]) -> None:
        for engine in engines:
            engine.end_step(main_waits=self.main_waits)  # else each module's forward waits

    def release_grads(self) -> None:
        for engine in self.engines.values():
            engine.release_grads()  # slots held since backward reference the grads just dropped
