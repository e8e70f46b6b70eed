"""The schedule concern: when host buckets are updated, as one object per mode (``OffloadOptions.schedule``).

* :class:`AfterBackward` (default): every bucket inside ``step()``, after the whole backward;
  ``step(closure)`` and AMP's ``GradScaler`` work as with torch's optimizers.
* :class:`OverlappedSchedule` (``overlap_step_with_backward=True``): a bucket's update starts on
  a host worker during the final backward once its grads are final (:mod:`offload_fsdp.overlap`);
  ``step()`` finishes what backward started and refuses what this mode cannot honour.

The optimizer calls the same members whatever the mode; each schedule answers for its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from offload_fsdp.amp import grad_scaler_in_use, grad_scaler_skips_step, refuse_grad_scaler
from offload_fsdp.buckets import HostBucket
from offload_fsdp.copy_engine import CopyEngine
from offload_fsdp.overlap import OverlappedStep
from offload_fsdp.records import ParamShard
from offload_fsdp.speculative import SpeculationCounts, SpeculativeClip

__all__ = ["AfterBackward", "OverlappedSchedule", "StepSchedule"]

Push = Callable[[HostBucket, list[ParamShard]], None]


class StepSchedule(Protocol):
    """What the optimizer asks its schedule (both modes implement every member)."""

    @property
    def begun_engines(self) -> dict[int, CopyEngine]:
        """copy engines whose ``begin_step`` ran during backward (step() must not run it again)"""
        ...

    @property
    def speculation_counts(self) -> SpeculationCounts | None:
        """What speculative clipping did so far; None when the schedule does not speculate."""
        ...

    def watch(self, records: Iterable[ParamShard], owner: object) -> None:
        """New offloaded ``records`` of ``owner`` (the optimizer)."""

    def grad_arriving(self, record: ParamShard) -> None:
        """A backward hook is about to stage ``record``'s grad (raises for a grad its update would miss)."""

    def grad_staged(self, record: ParamShard) -> None:
        """``record``'s final grad is staged."""

    def start_step(self, optimizer: Any, closure: Any, records: list[ParamShard]) -> tuple[Any, set[int], bool]:
        """Begin ``step()``: (the closure's loss, ids of records already updated, skip the update)."""
        ...

    def updated_buckets(self) -> list[HostBucket]:
        """Buckets updated during backward whose params ``step()`` has yet to push."""
        ...

    @property
    def in_progress(self) -> bool:
        """Host updates of this step started during backward and ``step()`` has not ended it."""
        ...

    def end_step(self) -> None: ...

    def abandon(self) -> None:
        """After an error in ``step()``: push what was updated, end the step's bookkeeping."""

    def check_idle(self, what: str) -> None:
        """Raise when ``what`` would meet a half-applied step."""

    def grads_zeroed(self) -> None: ...

    def before_load(self) -> None:
        """A state-dict load is about to replace the state."""


class AfterBackward:
    """Every host bucket is updated inside ``step()``, after the whole backward (see the module doc)."""

    def __init__(self) -> None:
        self.begun_engines: dict[int, CopyEngine] = {}
        self.speculation_counts: SpeculationCounts | None = None

    def watch(self, records: Iterable[ParamShard], owner: object) -> None:
        pass

    def grad_arriving(self, record: ParamShard) -> None:
        pass

    def grad_staged(self, record: ParamShard) -> None:
        pass

    def start_step(self, optimizer: Any, closure: Any, records: list[ParamShard]) -> tuple[Any, set[int], bool]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss, set(), grad_scaler_skips_step(optimizer, records)

    def updated_buckets(self) -> list[HostBucket]:
        return []

    @property
    def in_progress(self) -> bool:
        return False

    def end_step(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def check_idle(self, what: str) -> None:
        pass

    def grads_zeroed(self) -> None:
        pass

    def before_load(self) -> None:
        pass


class OverlappedSchedule:
    """Buckets updated during the final backward on a host worker (:class:`~offload_fsdp.overlap.OverlappedStep`).

    ``prepare(bucket)``: main-thread work before a bucket's update (the masters' refresh);
    ``update(bucket, records)``: the update itself, run on the worker, params not pushed;
    ``group(i)``: a param group; ``push``: queue a bucket's H2D; ``restore_master``: make an
    offloaded record's master its param widened again (a discarded step).
    """

    def __init__(
        self,
        prepare: Callable[[HostBucket], None],
        update: Push,
        group: Callable[[int], dict[str, Any]],
        *,
        push: Push,
        restore_master: Callable[[ParamShard], None],
        on_worker_start: Callable[[], None] = lambda: None,
        speculation: SpeculativeClip | None = None,
    ) -> None:
        self.overlapped = OverlappedStep(prepare, update, group, on_worker_start, speculation)
        self._push, self._restore_master = push, restore_master

    @property
    def begun_engines(self) -> dict[int, CopyEngine]:
        return self.overlapped.begun_engines

    @property
    def speculation_counts(self) -> SpeculationCounts | None:
        speculation = self.overlapped.speculation
        return speculation.counts if speculation is not None else None

    def watch(self, records: Iterable[ParamShard], owner: object) -> None:
        self.overlapped.register(records, owner)

    def grad_arriving(self, record: ParamShard) -> None:
        self.overlapped.check_not_started(record)  # a grad its update would miss

    def grad_staged(self, record: ParamShard) -> None:
        self.overlapped.grad_final(record)

    def start_step(self, optimizer: Any, closure: Any, records: list[ParamShard]) -> tuple[Any, set[int], bool]:
        """Refusals, then wait for the updates started during backward."""
        self.overlapped.check_backward_finished("step()")  # nothing to abandon: refused until a load
        try:
            if closure is not None:
                raise ValueError(
                    "step(closure) is not supported with overlap_step_with_backward=True: the host updates start "
                    "during the backward before step(), not inside the closure; call loss.backward() and then "
                    "step() without a closure, or build the optimizer without overlap_step_with_backward"
                )
            if self.overlapped.speculation is None:
                refuse_grad_scaler(optimizer)
            # With speculative clipping GradScaler is allowed: the updates ran on scaled grads, all are redone.
            amp = grad_scaler_in_use(optimizer)
            done = self.overlapped.finish_backward(keep=not amp)  # raises a worker's error, naming the bucket
            if amp and grad_scaler_skips_step(optimizer, records):
                self.overlapped.discard()  # inf/NaN: nothing applied, as torch skips the step
                return None, set(), True
            return None, done, False
        except BaseException:
            self.abandon()
            raise

    def updated_buckets(self) -> list[HostBucket]:
        return self.overlapped.updated_buckets()

    @property
    def in_progress(self) -> bool:
        return self.overlapped.in_progress

    def end_step(self) -> None:
        self.overlapped.end_step()

    def abandon(self) -> None:
        """End the copy engines begun during backward; the buckets updated before the error keep their update."""
        begun = self.overlapped.begun_engines.values()
        for engine in begun:
            engine.note_params_read()  # write their params after backward's reads
        for bucket in self.overlapped.updated_buckets():
            self._push(bucket, bucket.records)
        for engine in begun:
            engine.end_step()  # the next forward waits for those H2D
        self.overlapped.end_step()

    def check_idle(self, what: str) -> None:
        self.overlapped.check_idle(what)

    def grads_zeroed(self) -> None:
        self.overlapped.check_idle("zero_grad()")  # the update of these grads already ran in part
        self.overlapped.forget_readiness()

    @torch.no_grad()
    def before_load(self) -> None:
        """A backward that raised after updates started: discard that step (the load replaces what its updates
        changed; masters that were exact upcasts, which a checkpoint does not hold, are copied from the params
        again). Otherwise refuse while the worker may still be updating this state."""
        if not self.overlapped.backward_raised:
            self.overlapped.check_idle("load_state_dict()")
            return
        for bucket in self.overlapped.discard():
            for r in bucket.records:
                if r.master_is_upcast:
                    self._restore_master(r)
